"""Host cost of admitting one steered request, by the form its spec takes (CPU or GPU host).

Times ``LLMEngine.add_request`` (vLLM's input processing, dynsteer's admission and the hand-off
to the engine core) for requests whose spec names a registered vector, carries it as base64
float32, or as a Python float list (a dict spec, as the Python usage shows it; and the same as
JSON text), against requests without a spec. ``--distinct`` specs are cycled through (request
``i`` uses spec ``i % distinct``). Requests are aborted unrun: only admission is timed.

Prints microseconds per request (median over repetitions) and the excess over ``none``.

Usage: python benchmarks/admission.py [--model PATH] [--requests 256] [--distinct 16]
       [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = [1]
PROMPT = list(range(1, 129))


def specs(kind: str, vectors: np.ndarray) -> list[Any]:
    """One spec per distinct vector, as ``kind`` gives it (None: no spec)."""
    def entry(i: int) -> dict[str, Any]:
        if kind == "name":
            return {"vector": "registered", "layers": LAYERS}
        if kind == "b64":
            return {"vector_b64": base64.b64encode(vectors[i].tobytes()).decode(),
                    "layers": LAYERS}
        return {"vector": vectors[i].tolist(), "layers": LAYERS}

    if kind == "none":
        return [None] * len(vectors)
    made = [{"steer": [entry(i)]} for i in range(len(vectors))]
    return [json.dumps(s) for s in made] if kind == "list-json" else made


KINDS = ("none", "name", "b64", "list", "list-json")


def time_admission(llm: Any, batch: list[Any], rep: int) -> float:
    """Seconds per request to add ``batch`` (specs) to the engine, then abort them."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = [f"r{rep}-{i}" for i in range(len(batch))]
    params = [SamplingParams(max_tokens=1, extra_args=None if spec is None else
                             {"dynsteer": spec}) for spec in batch]
    start = time.perf_counter()
    for request_id, p in zip(ids, params, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": PROMPT}, p)
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    return elapsed / len(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder (default: the embedded default model)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--distinct", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # CPU builds: a small KV cache
    from vllm import LLM

    from dynsteer.engine_ext import Steering
    from dynsteer.engine_ext.default_model import default_model_path

    llm = LLM(str(args.model or default_model_path()), additional_config={"dynsteer": {}},
              max_model_len=512)
    steering = Steering(llm)
    hidden = steering.hidden_size
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.distinct, hidden)).astype(np.float32)
    steering.register_vector("registered", vectors[0])
    batches = {kind: [s for _, s in zip(range(args.requests),
                                        _cycle(specs(kind, vectors)), strict=False)]
               for kind in KINDS}
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for rep in range(args.reps):
        order = KINDS if rep % 2 == 0 else KINDS[::-1]
        for kind in order:
            seconds[kind].append(time_admission(llm, batches[kind], rep))
    us = {kind: statistics.median(v) * 1e6 for kind, v in seconds.items()}
    print(f"hidden {hidden}, {args.requests} requests, {args.distinct} distinct specs")
    print(f"{'spec':<10} {'µs/request':>11} {'excess':>8}")
    for kind in KINDS:
        print(f"{kind:<10} {us[kind]:>11.1f} {us[kind] - us['none']:>8.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"hidden": hidden, "requests": args.requests,
                                        "distinct": args.distinct, "us": us}, indent=1))


def _cycle(items: list[Any]):
    while True:
        yield from items


if __name__ == "__main__":
    main()
