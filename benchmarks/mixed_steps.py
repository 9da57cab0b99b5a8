"""What a step that admits a request costs: stock vLLM against the plugin (GPU).

Serving traffic's slow steps are the mixed ones: a new prompt's prefill beside the running
decodes, run under PIECEWISE graphs (attention eager between the graphed pieces) where decode
steps replay one FULL graph. ``serving.py`` sees them as the inter-token gap of the step
before a request's first token. This measures them directly, one engine at a time in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees the worker), Llama-8B shape
of ``overhead.py``, graphs on:

* ``decode``: ``--batch`` running requests, ``--steps`` steps of ``LLMEngine.step()``, wall
  time per step;
* ``mixed``: the same, with a new request (``PROMPT`` tokens, a few generated) added before
  every ``--every``-th step; the extra wall time per admission is the loop's time over the
  decode loop's, divided by the admissions (robust to which ``step()`` call returns what);
* a torch profile of a mixed loop: per step, the kernels' GPU time and the host's busiest
  ops (self CPU time), written as ``mixed_steps_NAME_profile.txt``;
* Python's garbage collections during the loops (count and seconds per generation, the
  objects each generation tracks after them), the wall time of every step, and for a
  plugin engine its own hooks' host time (``Steering.info()``);
* the CPU seconds and run-queue wait of each thread of the process during the loops, and what
  bounds its threads (:mod:`proc_cpu`), and the time of a few trivial host calls before the
  engine starts and after its loops (:func:`host_probe`).

Engines (``--engines``, each in a subprocess of its own): ``stock`` (plugin not enabled),
``idle`` (default sites), ``unfused`` (default sites, ``fused_norms`` off). Writes
``mixed_steps_NAME.json`` per engine and prints a table against stock.

``--interleave``: every engine alive at once in this process (each engine core a process of
its own, so no profile), their loops alternating rep by rep, each engine's requests aborted
between its turns (its engine core would otherwise go on stepping them); writes
``mixed_steps_interleaved.json`` with each rep's extra time per admission per engine and its
ratio to stock's in the same rep. Why: an engine's host speed drifts by a third within one
process and differs more between processes on the lent machines (session 29: stock's admission
steps 13.6 ms in one rep and 18.6 ms in the next), so only engines measured turn about, under
the same ``taskset``, can be compared.

Usage: python benchmarks/mixed_steps.py --out DIR [--engines stock,idle,unfused]
       [--batch 64] [--steps 96] [--every 4] [--interleave --mem 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import make_model, start
from proc_cpu import Window, describe, process_facts
from sigterm import exits_on_sigterm

PROMPT = 128
ENGINES: dict[str, dict[str, Any] | None] = {
    "stock": None,
    "idle": {},
    "unfused": {"fused_norms": False},
}


def start_engine(name: str, mem: float) -> Any:
    """Engine ``name`` of :data:`ENGINES` on ``overhead.py``'s model and settings."""
    return start(make_model(), ENGINES[name], mem)


class Loop:
    """Steps of one engine with ``batch`` long-running requests, new ones added on demand."""

    def __init__(self, llm: Any, batch: int) -> None:
        from vllm import SamplingParams

        self.llm = llm  # the engine lives as long as its LLM object
        self.engine = llm.llm_engine
        self.batch = batch
        self.rng = np.random.default_rng(0)
        self.count = 0
        self.long = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True,
                                   detokenize=False)
        self.short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                    detokenize=False)
        self.fill()

    def fill(self) -> None:
        """``batch`` long-running requests, every prompt prefilled, the batch decoding."""
        for _ in range(self.batch):
            self.add(self.long)
        for _ in range(8):
            self.engine.step()

    def drain(self) -> None:
        """Abort every request and wait until none is left: an engine core of its own process
        keeps stepping while it has requests, whether or not anyone calls ``step()``."""
        self.engine.abort_request([f"r{i}" for i in range(self.count)])
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def add(self, params: Any) -> None:
        prompt = {"prompt_token_ids": self.rng.integers(100, 30000, PROMPT).tolist()}
        self.engine.add_request(f"r{self.count}", prompt, params)
        self.count += 1

    def run(self, steps: int, every: int) -> list[float]:
        """Wall seconds of each ``step()``; a new request before every ``every``-th one
        (0: none)."""
        times = []
        for i in range(steps):
            if every and i % every == 0:
                self.add(self.short)
            t = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t)
        return times


def profile(loop: Loop, steps: int, every: int) -> str:
    """A profiled mixed loop: kernels' GPU time and the host ops' self CPU time, per step."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        loop.run(steps, every)
        torch.cuda.synchronize()
    kernels = {"count": 0, "us": 0.0, "graph_launches": 0}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels["count"] += 1
            kernels["us"] += event.time_range.elapsed_us()
        elif event.name == "cudaGraphLaunch":
            kernels["graph_launches"] += 1
    table = prof.key_averages()
    head = (f"{steps} steps, a request before every {every}-th: {kernels['count'] / steps:.1f} "
            f"GPU activities ({kernels['us'] / steps:.1f} us) and "
            f"{kernels['graph_launches'] / steps:.1f} graph launches per step\n\n")
    return head + "\n\n".join(table.table(sort_by=key, row_limit=30, max_name_column_width=90)
                              for key in ("self_cpu_time_total", "self_cuda_time_total"))


def host_probe() -> dict[str, float]:
    """µs per call of a Python function call, ``torch.empty(10)`` and (on CUDA) a trivial
    driver call, best of 5: taken before the engine starts and after its loops, it tells a
    process-wide slowdown (a spinning thread, a tracer, a slower core) from a slower step."""
    import timeit

    import torch

    def call(x: int) -> int:
        return x + 1

    cases = {"python_call": ("call(1)", 20000), "torch_empty": ("torch.empty(10)", 20000)}
    if torch.cuda.is_available():
        cases["cuda_stream_query"] = ("stream.query()", 20000)
    names = {"call": call, "torch": torch,
             "stream": torch.cuda.current_stream() if torch.cuda.is_available() else None}
    return {key: min(timeit.repeat(stmt, globals=names, number=n, repeat=5)) / n * 1e6
            for key, (stmt, n) in cases.items()}


def extra_per_admission(decode: list[float], mixed: list[float], args: argparse.Namespace) -> float:
    """Seconds a mixed loop took over a decode loop of as many steps, per request it admitted."""
    return (sum(mixed) - sum(decode)) / -(-args.steps // args.every)


class GcTimer:
    """Collections and their seconds per generation while inside the ``with`` block: a pause
    lands in whichever op allocated, so a process with more (or longer) collections shows
    every Python-heavy op slower in a profile."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t

    def __enter__(self) -> GcTimer:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def result(self) -> dict[str, Any]:
        import gc

        return {"collections": self.count, "seconds": [round(s, 4) for s in self.seconds],
                "tracked": [len(gc.get_objects(g)) for g in range(3)],
                "frozen": gc.get_freeze_count(), "enabled": gc.isenabled(),
                "thresholds": gc.get_threshold()}


def plugin_host_time(llm: Any, name: str) -> dict[str, Any] | None:
    """The plugin's hooks' host time so far (``Steering.info()``), None for stock."""
    if ENGINES[name] is None:
        return None
    from dynsteer.engine_ext import Steering

    return Steering(llm).info()[0]["host_time"]


def one_engine(name: str, args: argparse.Namespace) -> None:
    probe_before = host_probe()
    llm = start_engine(name, args.mem)
    loop = Loop(llm, args.batch)
    loop.run(args.steps, args.every)  # warm: every admission path once
    decode, mixed = [], []
    hooks_before = plugin_host_time(llm, name)
    with Window() as cpu, GcTimer() as gc_timer:  # a thread burning CPU beside the engine's
        for _ in range(args.reps):  # alternate, so drift hits both
            decode.append(loop.run(args.steps, 0))
            mixed.append(loop.run(args.steps, args.every))
    extra = [extra_per_admission(d, m, args) for d, m in zip(decode, mixed, strict=True)]
    result = {"engine": name, "options": ENGINES[name], "batch": args.batch,
              "steps": args.steps, "every": args.every,
              "decode_step_ms": float(np.median(np.concatenate(decode))) * 1e3,
              "extra_per_admission_ms": float(np.median(extra)) * 1e3,
              "extra_per_admission_ms_all": [e * 1e3 for e in extra],
              "mixed_loop_s": [sum(m) for m in mixed], "decode_loop_s": [sum(d) for d in decode],
              "mixed_step_ms": [[round(t * 1e3, 3) for t in m] for m in mixed],
              "gc": gc_timer.result(),
              "hooks_host_time": {"before": hooks_before, "after": plugin_host_time(llm, name)},
              "cpu": cpu.result, "host_probe_us": {"before_start": probe_before,
                                                   "after_loops": host_probe()},
              "process": process_facts()}
    (args.out / f"mixed_steps_{name}_profile.txt").write_text(profile(loop, 32, args.every))
    (args.out / f"mixed_steps_{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    print(f"{name}: CPU during the loops: {describe(cpu.result)}", flush=True)
    print(f"{name}: GC during the loops: {result['gc']}", flush=True)


def _write_interleaved(args: argparse.Namespace, extra: dict[str, list[float]],
                       step_ms: dict[str, list[dict[str, float]]],
                       cpu: dict[str, Any]) -> dict[str, Any]:
    """``mixed_steps_interleaved.json`` from the reps so far; returns what it wrote."""
    result: dict[str, Any] = {"batch": args.batch, "steps": args.steps, "every": args.every,
                              "reps": args.reps, "extra_per_admission_ms": extra,
                              "mean_step_ms": step_ms, "cpu": cpu,
                              "affinity": sorted(os.sched_getaffinity(0))}
    if "stock" in extra:
        result["ratio_to_stock"] = {
            name: [e / s for e, s in zip(values, extra["stock"], strict=True)]
            for name, values in extra.items()}
    (args.out / "mixed_steps_interleaved.json").write_text(json.dumps(result, indent=2))
    return result


def interleaved(args: argparse.Namespace) -> None:
    """All of ``--engines`` in this process, their loops turn about (see the module doc)."""
    names = args.engines.split(",")
    loops = {}
    for name in names:  # each engine idle (drained) while the others start and run
        loops[name] = Loop(start_engine(name, args.mem), args.batch)
        loops[name].run(args.steps, args.every)  # warm: every admission path once
        loops[name].drain()
    extra: dict[str, list[float]] = {name: [] for name in names}
    step_ms: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with Window() as cpu:
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                loop = loops[name]
                loop.fill()
                decode = loop.run(args.steps, 0)
                mixed = loop.run(args.steps, args.every)
                loop.drain()
                extra[name].append(extra_per_admission(decode, mixed, args) * 1e3)
                step_ms[name].append({"decode": sum(decode) / len(decode) * 1e3,
                                      "mixed": sum(mixed) / len(mixed) * 1e3})
            _write_interleaved(args, extra, step_ms, {})  # a call cut short keeps its reps
    result = _write_interleaved(args, extra, step_ms, cpu.result)
    print(f"{'engine':<10} {'extra/admission ms (median)':>28} {'per rep':>40} "
          f"{'ratio to stock (median)':>24}")
    for name in names:
        ratio = (float(np.median(result["ratio_to_stock"][name]))
                 if "ratio_to_stock" in result else float("nan"))
        reps = " ".join(f"{e:.2f}" for e in extra[name])
        print(f"{name:<10} {float(np.median(extra[name])):>28.3f} {reps:>40} {ratio:>24.3f}")
    print(f"CPU during the loops: {describe(cpu.result)}", flush=True)


@exits_on_sigterm
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engines", default="stock,idle,unfused")
    ap.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", type=float, default=0.6)
    ap.add_argument("--interleave", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Set here, not at import (a test importing this module must not change how the rest of
    # its session starts engines): several engines in one process need their own engine cores;
    # one engine per process runs in it, so that the profiler sees the worker.
    if args.interleave:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        interleaved(args)
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.engine:
        one_engine(args.engine, args)
        return
    passed = [f"--{k}={getattr(args, k)}" for k in ("out", "batch", "steps", "every", "reps",
                                                    "mem")]
    for name in args.engines.split(","):  # each engine in a process of its own
        subprocess.run([sys.executable, "-u", __file__, *passed, "--engine", name], check=False)
    rows = {}
    for name in args.engines.split(","):
        f = args.out / f"mixed_steps_{name}.json"
        if f.exists():
            rows[name] = json.loads(f.read_text())
    base = rows.get("stock")
    print(f"{'engine':<10} {'decode ms':>10} {'extra/admission ms':>19} {'ratio':>7}")
    for name, r in rows.items():
        ratio = (r["extra_per_admission_ms"] / base["extra_per_admission_ms"]
                 if base else float("nan"))
        print(f"{name:<10} {r['decode_step_ms']:>10.3f} {r['extra_per_admission_ms']:>19.3f} "
              f"{ratio:>7.3f}")


if __name__ == "__main__":
    main()
