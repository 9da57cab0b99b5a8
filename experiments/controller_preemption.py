"""Controlled requests under preemption: do they equal themselves run alone? (CPU, tiny model)

Built-in controllers decide per step (README, "Controllers"), so a request that vLLM preempts
and recomputes can be steered differently from the same request alone: its earlier tokens are
recomputed under the controller state of the moment. This script shows it, and is the check
to rerun when decisions are replayed exactly.

One engine of the tiny test Llama with a KV cache of 6 blocks of 32 tokens (the set-up of
``tests/test_preemption.py``) runs 4 requests of 40 + 40 tokens at once, gated at
``post_block@0``, twice: with the ``latch`` controller (a different ``k`` per request, so the
latches fall at different steps), and without a controller (the control: gates alone are exact
under preemption). Each request is then sent again alone. Printed and written to
``controller_preemption.json``: preemptions per batch, and per request whether the tokens match
and the largest |Δ logprob| against the run alone.

Usage: PYTHONPATH=tests python experiments/controller_preemption.py --out DIR
       (the engine is started by the tests' helpers, ``tests/engine_utils.py``)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

GATE = {"layer": 0, "steer": [{"layers": [0, 2]}]}
LATCH_K = (5, 15, 25, 35)
GENERATED = 40


def compare(batched: list[Any], alone: list[Any]) -> list[dict[str, Any]]:
    from engine_utils import logprobs_of

    rows = []
    for a, b in zip(batched, alone, strict=True):
        (ta, la), (tb, lb) = logprobs_of(a), logprobs_of(b)
        rows.append({"same_tokens": ta == tb,
                     "max_dlogprob": float(np.max(np.abs(np.asarray(la) - np.asarray(lb))))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        from engine_utils import params, run, start_llm, stop_llm
        from tiny_models import ARCHITECTURES, make_tiny_model, stable_model_dir, vec
    except ImportError:
        parser.error("the tests' helpers are not importable: run from the repository root "
                     "with PYTHONPATH=tests")

    path = stable_model_dir("tiny-llama", lambda p: make_tiny_model("llama", p), "llama",
                            ARCHITECTURES["llama"])
    gate = {**GATE, "probe": {"weights": vec(63, norm=1.0), "threshold": 0.0, "sharpness": 2.0},
            "steer": [{**GATE["steer"][0], "vector": vec(64)}]}
    cases = {"latch": [{"gate": gate, "controller": {"name": "latch", "k": k}} for k in LATCH_K],
             "gate only": [{"gate": gate}] * len(LATCH_K)}
    prompts = [[1, *np.random.RandomState(i).randint(3, 500, 39).tolist()]
               for i in range(len(LATCH_K))]
    llm = start_llm(path, dynsteer={"monitor_sites": "post_block@0"}, block_size=32,
                    num_gpu_blocks_override=6, max_model_len=128, max_num_seqs=4,
                    disable_log_stats=False)

    def preemptions() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")

    results: dict[str, Any] = {}
    try:
        for name, specs in cases.items():
            before = preemptions()
            batched = run(llm, prompts, [params(GENERATED, spec=s) for s in specs])
            during = preemptions() - before
            alone = [run(llm, [p], [params(GENERATED, spec=s)])[0]
                     for p, s in zip(prompts, specs, strict=True)]
            results[name] = {"preemptions": during, "requests": compare(batched, alone)}
    finally:
        stop_llm(llm)
    for name, result in results.items():
        print(f"{name}: {result['preemptions']:.0f} preemptions")
        for i, row in enumerate(result["requests"]):
            print(f"  request {i}: same tokens {row['same_tokens']}, "
                  f"max |dlogprob| {row['max_dlogprob']:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "controller_preemption.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
