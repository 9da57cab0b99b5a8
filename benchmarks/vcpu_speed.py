"""How fast each CPU runs a fixed piece of Python, probe after probe: a map of the machine's
CPUs over time.

Why: on the lent machines (Firecracker VMs) a serving load whose engine core's main thread
stayed on one CPU ran vLLM's own host work slower, for plain vLLM and for the plugin (session
46, ``serving_pool.py``'s placement split), and sessions 28-37 saw every host operation of an
engine core 1.4-2x slower for stretches with no run-queue wait, no steal and the clock steady.
A guest cannot see which of its virtual CPUs share a host core (the host's SMT siblings) or
are slowed by the host's other work. This probe pins itself to each CPU in turn and times the
same interpreter work there (dict, list and integer operations: what an engine step's Python
does), so a CPU that is slower, or slower at times, shows as its own row. Run it before and
after a load on every CPU, and during a load on the CPUs the servers do not use (a probe on a
busy CPU slows the load it measures).

Usage: python benchmarks/vcpu_speed.py [--cpus 0-15] [--rounds 5] [--work 20000]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from proc_cpu import cpu_list


def work(n: int) -> int:
    """A fixed piece of interpreter work: ``n`` rounds of dict, list and integer operations."""
    table: dict[int, int] = {}
    items: list[int] = []
    total = 0
    for i in range(n):
        table[i & 1023] = i
        items.append(i)
        total += table.get(i & 511, 0) ^ len(items)
        if len(items) > 64:
            items.clear()
    return total


def probe(cpu: int, n: int) -> float:
    """Nanoseconds per round of :func:`work` on ``cpu`` (this process pinned there, once
    run first so the pinning has taken and the code is warm)."""
    os.sched_setaffinity(0, {cpu})
    work(n // 10)
    start = time.perf_counter_ns()
    work(n)
    return (time.perf_counter_ns() - start) / n


def speed_map(cpus: list[int], rounds: int, n: int) -> dict[str, Any]:
    """Each CPU probed ``rounds`` times, the CPUs in turn within a round (so a CPU's probes
    are spread over the run): per CPU its probes (ns a round, with their wall-clock offsets)
    and its median over the median of all CPUs' medians (>1: slower)."""
    allowed = os.sched_getaffinity(0)
    begun = time.monotonic()
    probes: dict[int, list[tuple[float, float]]] = {cpu: [] for cpu in cpus}
    try:
        for _ in range(rounds):
            for cpu in cpus:
                probes[cpu].append((round(time.monotonic() - begun, 3), probe(cpu, n)))
    finally:
        os.sched_setaffinity(0, allowed)
    medians = {cpu: float(np.median([ns for _, ns in p])) for cpu, p in probes.items()}
    middle = float(np.median(list(medians.values())))
    return {"work": n, "rounds": rounds, "cpus": {
        str(cpu): {"median_ns": medians[cpu], "relative": medians[cpu] / middle,
                   "slowest_relative": max(ns for _, ns in probes[cpu]) / middle,
                   "probes": probes[cpu]} for cpu in cpus}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default=None,
                    help="a taskset -c list (default: the CPUs this process may run on)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=int, default=20000, help="rounds of work per probe")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cpus = cpu_list(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    if not set(cpus) <= os.sched_getaffinity(0):
        ap.error(f"--cpus: this process may run only on {sorted(os.sched_getaffinity(0))}")
    result = speed_map(cpus, args.rounds, args.work)
    print(f"{'cpu':>4} {'ns/round':>9} {'relative':>9} {'slowest':>8}")
    for cpu, row in result["cpus"].items():
        print(f"{cpu:>4} {row['median_ns']:>9.1f} {row['relative']:>9.3f} "
              f"{row['slowest_relative']:>8.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
