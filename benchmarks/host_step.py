"""Host time of one decode step of a worker's steering state, without an engine (CPU or GPU).

The real :class:`~dynsteer.engine_ext.worker.state.SteeringState` (Llama-8B sizes: hidden 4096,
32 ``post_block`` sites, monitor at 16) with ``N`` gated requests, each with the scenario's
controller, runs decode steps as the runner hooks drive it: ``fill`` (index, controllers) then
``cache_report`` (read-back, telemetry fold, prefix-guard report), with fresh gates written
between steps as a forward would; ``gated-churn`` also finishes one request and admits one
in its slot every step (its prompt in the step), as an admission step does. Prints µs per
step per scenario and request count, the top functions of one profiled configuration, and
writes ``host_step.json``.

Usage: python benchmarks/host_step.py --out DIR [--device cuda] [--steps 400]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path
from typing import Any

HIDDEN = 4096
LAYERS = 32
MONITOR = 16
PROMPT = 128
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "gated": None,
    "latch": {"name": "latch", "k": 1_000_000},
    "proportional": {"name": "proportional"},
    "python": {"name": "bench-latch"},
}


def make_state(requests: int, controller: dict[str, Any] | None, device: Any) -> Any:
    import numpy as np

    from dynsteer.controller.spec import parse_spec
    from dynsteer.controller.wire import WIRE_KEY, spec_to_wire
    from dynsteer.engine_ext.worker.state import SteeringState

    sites = tuple(("post_block", layer) for layer in range(LAYERS))
    state = SteeringState(sites, HIDDEN, max_rows=64, max_tokens=max(8192, requests * PROMPT),
                          max_slots=requests + 1,
                          device=device, block_size=16)
    rng = np.random.default_rng(0)
    spec: dict[str, Any] = {"gate": {
        "probe": {"weights": (rng.standard_normal(HIDDEN) / HIDDEN**0.5).tolist()},
        "layer": MONITOR, "steer": [{"vector": (rng.standard_normal(HIDDEN) * 0.01).tolist(),
                                     "layers": list(range(16, 24))}]}}
    if controller is not None:
        spec["controller"] = controller
    wire = {WIRE_KEY: spec_to_wire(parse_spec(spec))}
    for i in range(requests):
        state.add_request(f"r{i}", i + 1, wire, PROMPT)
    state.bench_wire = wire
    return state


def run_steps(state: Any, requests: int, steps: int, device: Any, churn: bool = False) -> float:
    """µs per decode step (after a prefill step and a warm-up). ``churn``: in every step one
    request finishes and a new one takes its slot, its prompt in the step (an admission
    step, where serving latency is host-bound)."""
    import numpy as np
    import torch

    slots = np.arange(1, requests + 1)
    state.fill(slots, np.zeros(requests, np.int64), np.full(requests, PROMPT))
    state.cache_report()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gates = torch.rand(steps + 8, requests * PROMPT, device=device)
    computed = np.full(requests, PROMPT, np.int64)
    ids = [f"r{i}" for i in range(requests)]
    elapsed = 0.0
    for k in range(steps + 8):
        scheduled = np.ones(requests, np.int64)
        state.gate[: requests * PROMPT] = gates[k]  # what the forward would have written
        sync()
        start = time.perf_counter()
        if churn:
            i = k % requests
            state.remove_request(ids[i])
            ids[i] = f"r{i}-{k}"
            state.add_request(ids[i], i + 1, state.bench_wire, PROMPT)
            computed[i], scheduled[i] = 0, PROMPT
        state.fill(slots, computed, scheduled)
        state.cache_report()
        computed += scheduled
        if k >= 8:
            elapsed += time.perf_counter() - start
    return elapsed / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--profile", default="latch", choices=list(SCENARIOS))
    ap.add_argument("--scenarios", nargs="+", default=[*SCENARIOS, "gated-churn"],
                    choices=[*SCENARIOS, "gated-churn"])
    args = ap.parse_args()
    import bench_controllers
    import torch

    bench_controllers.install()
    device = torch.device(args.device)
    table: dict[str, dict[int, float]] = {}
    for name in args.scenarios:  # gated-churn: an admission and a finish in every step
        churn = name == "gated-churn"
        for n in args.requests:
            state = make_state(n, None if churn else SCENARIOS[name], device)
            table.setdefault(name, {})[n] = run_steps(state, n, args.steps, device, churn)
    profiler = cProfile.Profile()
    state = make_state(32, SCENARIOS[args.profile], device)
    profiler.enable()
    run_steps(state, 32, args.steps, device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    print(f"host µs per decode step ({args.device}):")
    print(f"{'scenario':<14}" + "".join(f"{n:>10}" for n in args.requests))
    for name, row in table.items():
        print(f"{name:<14}" + "".join(f"{row[n]:>10.0f}" for n in args.requests))
    print(text.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step.json").write_text(json.dumps(
        {"device": args.device, "us_per_step": table, "profile": text.getvalue()}, indent=2))


if __name__ == "__main__":
    main()
