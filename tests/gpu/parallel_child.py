"""One layout of ``test_gpu_parallel.py``, in a process of its own (a second engine in one
process does not start reliably on GPUs): the tiny Llama's outputs under that layout, written
as JSON. Run by the test as ``python parallel_child.py LAYOUT MODEL OUT`` with ``tests/``,
``tests/gpu/`` and ``benchmarks/`` on ``PYTHONPATH``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from parallel_guard import GUARD_BLOCK, MONITOR_SITES, gate_spec, guard_run
from tp_settings import GPU_TP_KWARGS

LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
GPU_KWARGS: dict[str, Any] = {"gpu_memory_utilization": 0.3, **GPU_TP_KWARGS}
CAPTURE_SITES = "post_block@1,post_block@3"
"""Default monitor sites of the 4-layer model, one on each PP stage."""


def requests() -> tuple[list[list[int]], list[Any]]:
    """The prompts and specs every layout runs (tiny_models' shapes and vectors)."""
    from tiny_models import STATIC_CASES

    gate = {**gate_spec(), "trace": True}
    specs = [None, *({"steer": e} for e in STATIC_CASES.values()), {"gate": gate},
             {"gate": gate, "controller": {"name": "latch", "k": 2}},
             {"gate": gate, "controller": {"name": "proportional", "gain": 3.0}}]
    prompts = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 9, 8, 7]]
    return [prompts[i % 2] for i in range(len(specs))], specs


def untraced(specs: list[Any]) -> list[Any]:
    """The static and gated specs again, without traces and controllers: the steps that run
    only these are the ones vLLM's V2 runner on CUDA fills on the device (a traced gate or a
    controller needs the host fill)."""
    return [s if s is None or "gate" not in s else {"gate": {**s["gate"], "trace": False}}
            for s in specs if s is None or "controller" not in s]


def run_layout(layout: str, model: str, out: Path) -> None:
    """One layout's outputs, written as JSON."""
    import torch
    from engine_utils import ALL_SITES, logprobs_of, params, run, start_llm, stop_llm
    from tiny_models import vec

    from dynsteer.engine_ext import Steering

    prompts, specs = requests()
    started = time.monotonic()
    llm = start_llm(model, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES},
                    enable_prefix_caching=True, block_size=GUARD_BLOCK,
                    **LAYOUTS[layout], **GPU_KWARGS)
    ready = time.monotonic() - started
    try:
        steering = Steering(llm)
        outs = run(llm, prompts, [params(8, spec=s) for s in specs])
        fills_before = [rank["index_fills"] for rank in steering.info()]
        plain_specs = untraced(specs)
        plain_outs = run(llm, prompts[:len(plain_specs)],
                         [params(8, spec=s) for s in plain_specs])
        fills = [{k: rank["index_fills"][k] - before.get(k, 0) for k in rank["index_fills"]}
                 for rank, before in zip(steering.info(), fills_before, strict=True)]
        per_rank = [llm.collective_rpc("dynsteer_telemetry", args=(o.request_id,))
                    for o, s in zip(outs, specs, strict=True) if s and "gate" in s]
        steering.set_global([{"vector": vec(41), "layers": [0, 3]}])
        (under_global,) = run(llm, prompts[:1], [params(8)])
        steering.clear_global()
        (cleared,) = run(llm, prompts[:1], [params(8)])
        capture = steering.capture(prompts[1:3], CAPTURE_SITES, reduce="all")
        info = steering.info()  # the checksums of the specs' controllers, before the guard's
        guard = guard_run(llm, steering, model)
    finally:
        stop_llm(llm)

    def tokens_and_logprobs(o: Any) -> dict[str, Any]:
        tokens, lps = logprobs_of(o)
        return {"tokens": tokens, "logprobs": lps.tolist()}

    out.write_text(json.dumps({
        "layout": layout, "ready_s": ready,
        "outputs": [tokens_and_logprobs(o) for o in outs],
        "untraced_outputs": [tokens_and_logprobs(o) for o in plain_outs],
        "untraced_index_fills": fills, "cuda": torch.cuda.is_available(),
        "global": tokens_and_logprobs(under_global), "cleared": tokens_and_logprobs(cleared),
        "capture": {site: [a.tolist() for a in arrays] for site, arrays in capture.items()},
        "guard": guard,
        "per_rank_telemetry": [[{k: t[k] for k in ("gates", "scores", "controller")}
                                for t in ranks] for ranks in per_rank],
        "ranks": [{k: rank[k] for k in ("controller_checksum", "controller_checked_steps",
                                        "controller_checksum_log", "rows_rejected")}
                  for rank in info],
    }))


if __name__ == "__main__":
    run_layout(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
