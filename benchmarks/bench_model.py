"""Dummy-weight model folders for the GPU benchmarks, at a path that stays the same from call to
call.

vLLM keys its compile cache by the engine configuration, the model's path included. A model
written to a fresh temporary folder therefore compiles every engine again on every call, even on
a warm machine whose cache holds the same graphs from the call before: 40-60 s per dynsteer
engine of the Llama-8B shape on an H200 (a three-server ``serving.py`` call once spent 5.5 of
its 8 minutes starting servers). A folder named by what it holds keeps that key,
so the second call on a machine loads the first call's graphs.

The folders live under ``DYNSTEER_BENCH_MODELS`` (default ``~/.cache/dynsteer/bench-models``).
A folder is written under a temporary name and renamed into place, so two processes that make
the same model at once both end with one complete folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT_ENV = "DYNSTEER_BENCH_MODELS"
"""Where the folders go (read at each call, so a test can point it elsewhere)."""


def models_root() -> Path:
    """The folder that holds the benchmark models."""
    default = Path.home() / ".cache" / "dynsteer" / "bench-models"
    return Path(os.environ.get(ROOT_ENV) or default)


def dummy_model(name: str, config: dict[str, Any], files: Iterable[Path] = (),
                root: Path | None = None) -> Path:
    """A folder with ``config.json`` (``config``) and a copy of each of ``files`` (e.g. a
    tokenizer's), named ``NAME-DIGEST`` by a digest of all of them; made once per content.
    ``root``: where instead of :func:`models_root` (a temporary folder for a run that must
    not load an earlier call's compiled graphs)."""
    files = sorted(Path(f) for f in files)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    root = models_root() if root is None else root
    folder = root / f"{name}-{digest.hexdigest()[:12]}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    for f in files:
        shutil.copy(f, staging / f.name)
    (staging / "config.json").write_text(json.dumps(config))
    try:
        staging.rename(folder)
    except OSError:  # another process put the same folder in place first
        shutil.rmtree(staging)
    return folder


def memory_need_gib(config: dict[str, Any], tokens: int, margin_gib: float = 3.0) -> float:
    """GPU memory one bf16 engine of a Llama-shaped ``config`` needs to hold ``tokens`` tokens
    of KV cache at once: its weights, that cache, and ``margin_gib`` for activations and CUDA
    graphs. A benchmark whose engines get less than this either fails at start ("No available
    memory for the cache blocks") or, worse, preempts requests mid-run and times that."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config["intermediate_size"]
    embeddings = config["vocab_size"] * hidden * (1 if config["tie_word_embeddings"] else 2)
    weights = 2 * (layers * (attention + mlp) + embeddings)
    kv_per_token = 2 * 2 * layers * kv_heads * head_dim
    return (weights + tokens * kv_per_token) / 2**30 + margin_gib
