"""Host time of one decode step of a worker's steering state, without an engine (CPU or GPU).

The real :class:`~dynsteer.engine_ext.worker.state.SteeringState` (Llama-8B sizes: hidden 4096,
32 ``post_block`` sites, monitor at 16) with ``N`` gated requests, each with the scenario's
controller, runs decode steps as the runner hooks drive it: ``fill`` (index, controllers) then
``cache_report`` (read-back, telemetry fold, prefix-guard report), with fresh gates written
between steps as a forward would; ``gated-churn`` also finishes one request and admits one
in its slot every step (its prompt in the step), as an admission step does; ``mixed`` is
``serving.py``'s stream (plain, static and gated requests, one admitted every 12 steps); ``static``
steers each request by one vector at layers 16-23, ungated (where the device fill keeps a
decode step's index, and the prefix-guard report has nothing to do). Prints µs per
step per scenario and request count, the top functions of one profiled configuration, and
writes ``host_step.json``.

The lent GPU machine's host speed drifts (the same code measured 86 and 164 µs a step a minute
apart), so one run against another is no comparison. ``--rounds K`` measures in K fresh
processes and reports each figure's median and range; ``--baseline SRC`` (an older checkout of
this repository, e.g. from ``git archive``) alternates processes of that version with processes
of the installed one, ``--rounds`` of each, and reports the paired ratios (baseline / current
per round: > 1 means the current version is faster).

A lent machine's vCPUs also flip between two speeds within a tenth of a second (session 47:
~200 and ~410 ns a round of the same Python, ``vcpu_speed.py``), and in one comparison the
unchanged index fill ran 5-29% slower in every process of one version: a bias as large as the
effects measured. ``--control`` times a fixed piece of interpreter work
(:func:`vcpu_speed.work`) before every :data:`CONTROL_EVERY` steps, outside the timed part, and
adds each scenario's time at a fixed control speed (``"<name> at control speed"``: each step's
time scaled by :data:`CONTROL_NS` over the probe before it) and the probes' median (``"<name>
control ns"``); compare versions by the first.

Scenario ``NAME-device`` is ``NAME`` with the device filling the index from the runner's
device tensors (vLLM's V2 runner on CUDA; on CPU the kernel runs in Triton's interpreter only).

Usage: python benchmarks/host_step.py --out DIR [--device cuda] [--steps 400]
       [--rounds K] [--baseline SRC] [--control] [--scenarios gated gated-device ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN = 4096
LAYERS = 32
MONITOR = 16
PROMPT = 128
PACKAGES = ("engine_ext", "controller", "probes")
"""The source folders that ``pyproject.toml`` maps to ``dynsteer.<name>``."""
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "gated": None,
    "latch": {"name": "latch", "k": 1_000_000},
    "proportional": {"name": "proportional"},
    "python": {"name": "bench-latch"},
}


MIXED = ("plain", "static", "plain", "gated")
"""The kinds of ``mixed``'s requests in turn: serving.py's stream (half plain, a quarter static,
a quarter gated)."""
MIXED_CHURN = 12
"""``mixed``: steps per admission (serving.py's 16 requests/s at ~200 steps/s on an H200)."""
CONTROL_EVERY = 10
"""``--control``: steps per speed probe (a probe takes ~1 ms; ten steps take 0.5-3 ms)."""
CONTROL_WORK = 2000
"""``--control``: rounds of :func:`vcpu_speed.work` per probe."""
CONTROL_NS = 400.0
"""``--control``: the speed the scaled figures are given at, ns a round of the probe's work (a
lent H200 machine's vCPU at its usual speed, session 47)."""


class SpeedControl:
    """The host's speed now, from a fixed piece of interpreter work, and a time scaled to what
    it would have been at :data:`CONTROL_NS` (the same work, the same code, a CPU of a fixed
    speed)."""

    def __init__(self) -> None:
        from vcpu_speed import work

        self._work = work
        self._work(CONTROL_WORK)  # warm
        self.probes: list[float] = []

    def probe(self) -> None:
        start = time.perf_counter_ns()
        self._work(CONTROL_WORK)
        self.probes.append((time.perf_counter_ns() - start) / CONTROL_WORK)

    def scaled(self, seconds: float) -> float:
        """``seconds`` spent since the last probe, at the control speed."""
        return seconds * CONTROL_NS / self.probes[-1]


def make_state(requests: int, controller: dict[str, Any] | None, device: Any,
               static: bool = False, mixed: bool = False) -> Any:
    import numpy as np

    from dynsteer.controller.spec import parse_spec
    from dynsteer.controller.wire import WIRE_KEY, spec_to_wire
    from dynsteer.engine_ext.worker.state import SteeringState

    sites = tuple(("post_block", layer) for layer in range(LAYERS))
    state = SteeringState(sites, HIDDEN, max_rows=64, max_tokens=max(8192, requests * PROMPT),
                          max_slots=requests + 1,
                          device=device, block_size=16)
    rng = np.random.default_rng(0)
    steer = [{"vector": (rng.standard_normal(HIDDEN) * 0.01).tolist(),
              "layers": list(range(16, 24))}]
    gated: dict[str, Any] = {"gate": {
        "probe": {"weights": (rng.standard_normal(HIDDEN) / HIDDEN**0.5).tolist()},
        "layer": MONITOR, "steer": steer}}
    if controller is not None:
        gated["controller"] = controller
    wires = {kind: {WIRE_KEY: spec_to_wire(parse_spec(spec))}
             for kind, spec in (("static", {"steer": steer}), ("gated", gated))}
    wires["plain"] = None
    kinds = [MIXED[i % len(MIXED)] if mixed else "static" if static else "gated"
             for i in range(requests)]
    state.bench_wires = [wires[kind] for kind in kinds]
    """Each request's spec (by its index), which a request admitted in its place takes too."""
    for i in range(requests):
        state.add_request(f"r{i}", i + 1, state.bench_wires[i], PROMPT)
    return state


def batch_buffers(state: Any, requests: int, device: Any) -> Any:
    """Persistent ``query_start_loc`` and ``positions`` buffers as vLLM's V2 runner keeps
    them, handed to the state's device fill; returns a function that writes a step's batch
    into them (outside the timed part: that is the runner's work, not ours) and returns its
    slots as a device tensor."""
    import numpy as np
    import torch

    from dynsteer.engine_ext.worker.token_rows import expand_positions

    query_start = torch.zeros(requests + 1, dtype=torch.int32, device=device)
    positions = torch.zeros(requests * PROMPT, dtype=torch.int64, device=device)
    state.enable_device_fill(query_start, positions)

    def write(slots: Any, computed: Any, scheduled: Any) -> Any:
        starts = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        query_start.copy_(torch.from_numpy(starts))
        positions[: starts[-1]] = torch.from_numpy(expand_positions(computed, scheduled))
        return torch.from_numpy(slots.astype(np.int32)).to(device)

    return write


def run_steps(state: Any, requests: int, steps: int, device: Any, churn_every: int = 0,
              on_device: bool = False, control: SpeedControl | None = None
              ) -> tuple[float, float, float]:
    """µs per decode step (after a prefill step and a warm-up), and the µs of CPU time of
    the index fill alone (the ``step`` hook; the thread's clock, which another process's
    load on the machine does not inflate). ``churn_every``: every that many steps (1: every
    step; 0: never) one request finishes and a new one with its spec takes its slot, its
    prompt in the step (an admission step, where serving latency is host-bound).
    ``on_device``: the runner hands over its device tensors, so the device fills the index
    (vLLM's V2 runner on CUDA). Third: µs per step at ``control``'s speed (probed before every
    :data:`CONTROL_EVERY` steps; 0 without it)."""
    import numpy as np
    import torch

    slots = np.arange(1, requests + 1)
    write = batch_buffers(state, requests, device) if on_device else None
    state.fill(slots, np.zeros(requests, np.int64), np.full(requests, PROMPT))
    state.cache_report()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gates = torch.rand(steps + 8, requests * PROMPT, device=device)
    computed = np.full(requests, PROMPT, np.int64)
    ids = [f"r{i}" for i in range(requests)]
    elapsed = fill_cpu = scaled = 0.0
    for k in range(steps + 8):
        scheduled = np.ones(requests, np.int64)
        churn = churn_every > 0 and k % churn_every == 0
        i = k // max(churn_every, 1) % requests
        if churn:
            computed[i], scheduled[i] = 0, PROMPT
        extra = (write(slots, computed, scheduled),) if on_device else ()
        state.gate[: requests * PROMPT] = gates[k]  # what the forward would have written
        sync()
        if control is not None and k >= 8 and (k - 8) % CONTROL_EVERY == 0:
            control.probe()
        start = time.perf_counter()
        if churn:
            state.remove_request(ids[i])
            ids[i] = f"r{i}-{k}"
            state.add_request(ids[i], i + 1, state.bench_wires[i], PROMPT)
        fill_start = time.thread_time()
        state.fill(slots, computed, scheduled, *extra)
        fill_end = time.thread_time()
        state.cache_report()
        computed += scheduled
        if k >= 8:
            took = time.perf_counter() - start
            elapsed += took
            fill_cpu += fill_end - fill_start
            scaled += control.scaled(took) if control is not None else 0.0
    return elapsed / steps * 1e6, fill_cpu / steps * 1e6, scaled / steps * 1e6


def run_scenario(name: str, requests: int, steps: int, device: Any,
                 profiler: cProfile.Profile | None = None, control: SpeedControl | None = None
                 ) -> tuple[float, float, float]:
    """:func:`run_steps` of scenario ``name`` (``gated-churn``: an admission and a finish in
    every step; ``mixed``: the kinds of :data:`MIXED` in turn, an admission and a finish every
    :data:`MIXED_CHURN` steps; a ``-device`` suffix: the device fills the index), with
    ``profiler`` (if given) on for the steps alone and ``control`` (if given) probing."""
    base = name.removesuffix("-device")
    state = make_state(requests, SCENARIOS.get(base), device, static=base == "static",
                       mixed=base == "mixed")
    churn_every = {"gated-churn": 1, "mixed": MIXED_CHURN}.get(base, 0)
    if profiler is not None:
        profiler.enable()
    try:
        return run_steps(state, requests, steps, device, churn_every, base != name, control)
    finally:
        if profiler is not None:
            profiler.disable()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's figures: µs per step per scenario and request count (and of the fill's
    CPU time, as scenario ``"<name> fill CPU"``; with ``--control``, at the control speed and
    the probes' median: :class:`SpeedControl`), and a profile."""
    import bench_controllers
    import torch

    import dynsteer.engine_ext

    bench_controllers.install()
    device = torch.device(args.device)
    table: dict[str, dict[int, float]] = {}
    for name in args.scenarios:
        for n in args.requests:
            control = SpeedControl() if args.control else None
            step, fill, scaled = run_scenario(name, n, args.steps, device, control=control)
            table.setdefault(name, {})[n] = step
            table.setdefault(f"{name} fill CPU", {})[n] = fill
            if control is not None:
                table.setdefault(f"{name} at control speed", {})[n] = scaled
                table.setdefault(f"{name} control ns", {})[n] = statistics.median(
                    control.probes)
    profiler = cProfile.Profile()
    run_scenario(args.profile, args.profile_requests, args.steps, device, profiler)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    return {"device": args.device, "us_per_step": table, "profile": text.getvalue(),
            "package": str(Path(dynsteer.engine_ext.__file__).parent)}


def in_processes(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds, each a fresh process per version (baseline first), in turn."""
    versions = {"current": None}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline is not None:
            staged = Path(tmp) / "dynsteer"
            staged.mkdir()
            for name in PACKAGES:
                (staged / name).symlink_to((args.baseline / name).resolve())
            versions = {"baseline": tmp, **versions}
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in versions}
        flags = ["--device", args.device, "--steps", str(args.steps), "--profile", args.profile,
                 "--profile-requests", str(args.profile_requests),
                 "--requests", *map(str, args.requests), "--scenarios", *args.scenarios,
                 *(["--control"] if args.control else [])]
        for k in range(args.rounds):
            for version, path in versions.items():
                env = dict(os.environ)
                if path is not None:
                    env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
                out = Path(tmp) / f"{version}{k}"
                subprocess.run([sys.executable, __file__, "--out", str(out), "--one", *flags],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                got = json.loads((out / "host_step.json").read_text())
                expected = (args.baseline / "engine_ext").resolve() if path else None
                if expected is not None and Path(got["package"]).resolve() != expected:
                    raise SystemExit(f"the baseline round imported {got['package']}")
                rounds[version].append(got)
    return summarize(rounds, args)


def summarize(rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace
              ) -> dict[str, Any]:
    """Median and range per version, scenario and request count; paired ratios per round."""
    def cells(version: str, name: str, n: int) -> list[float]:
        return [r["us_per_step"][name][str(n)] for r in rounds[version]]

    result: dict[str, Any] = {"device": args.device, "rounds": args.rounds, "versions": {},
                              "profile": rounds["current"][-1]["profile"]}
    print(f"host µs per step ({args.device}), median [min-max] over {args.rounds} processes:")
    names = list(rounds["current"][0]["us_per_step"])
    for version in rounds:
        result["versions"][version] = {
            name: {n: {"median": statistics.median(cells(version, name, n)),
                       "range": [min(cells(version, name, n)), max(cells(version, name, n))]}
                   for n in args.requests} for name in names}
    for name in names:
        for n in args.requests:
            line = f"{name:<34}{n:>5}"
            for version in rounds:
                c = result["versions"][version][name][n]
                line += f"  {version} {c['median']:7.0f} [{c['range'][0]:.0f}-{c['range'][1]:.0f}]"
            if "baseline" in rounds:
                ratios = [b / c for b, c in zip(cells("baseline", name, n),
                                                cells("current", name, n), strict=True)]
                result.setdefault("ratios", {}).setdefault(name, {})[n] = ratios
                line += (f"  baseline/current {statistics.median(ratios):.2f} "
                         f"[{min(ratios):.2f}-{max(ratios):.2f}]")
            print(line)
    print(result["profile"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256])
    every = [*SCENARIOS, "gated-churn", "static", "mixed"]
    names = [*every, *(f"{name}-device" for name in every)]
    ap.add_argument("--scenarios", nargs="+", default=every, choices=names,
                    help="NAME-device: the device fills the index (the V2 runner on CUDA)")
    ap.add_argument("--profile", default="latch", choices=names,
                    help="the scenario profiled (cProfile, top functions by own time)")
    ap.add_argument("--profile-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="fresh processes per version, run in turn (medians and ranges)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="an older checkout of this repository to alternate with")
    ap.add_argument("--control", action="store_true",
                    help="probe the host's speed every few steps; add each scenario at a fixed "
                         "control speed (compare versions by it)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a round's process
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "engine_ext").is_dir():
        ap.error(f"--baseline {args.baseline}: no engine_ext folder (a checkout of this repo?)")
    if args.one or (args.rounds == 1 and args.baseline is None):
        result = measure(args)
        if not args.one:
            print(f"host µs per decode step ({args.device}):")
            print(f"{'scenario':<34}" + "".join(f"{n:>10}" for n in args.requests))
            for name, row in result["us_per_step"].items():
                print(f"{name:<34}" + "".join(f"{row[n]:>10.0f}" for n in args.requests))
            print(result["profile"])
    else:
        result = in_processes(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
