"""Host time dynsteer spends in one worker, per hook: what the serving-scale benchmark reports
as host work per step, and what the info RPC and ``/metrics`` expose for production dashboards.

Each hook keeps its total and a histogram of single calls (the tail is what
stretches a step: a mean hides one slow admission among hundreds of cheap steps), and the CPU
time its thread spent in it. Wall time minus CPU time is time the hook waited: for the GIL,
which the engine core's I/O threads take whenever a torch call in the hook releases it, or for
the GPU. In a serving engine the hooks' wall time can be several times what the same code costs
alone; the split says which part is ours to cut. Wrapping costs two
clock reads, two thread CPU-time reads (a system call each, ~0.7 µs) and a bisection per
call; nothing here allocates per call.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

HOOKS = ("admit", "finish", "step", "output")
"""``admit``/``finish``: once per request; ``step``: the index fill before each forward;
``output``: the telemetry fold and prefix-guard report after it."""
BUCKETS_US = (10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000)
"""Upper bounds (µs) of the histogram's buckets; a last one takes the calls above them."""


class HostTime:
    """Cumulative nanoseconds and a histogram of calls per hook (its calls are its sum)."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(HOOKS, 0)
        self.cpu_ns = dict.fromkeys(HOOKS, 0)
        """CPU time of the calling thread inside each hook."""
        self.buckets = {hook: [0] * (len(BUCKETS_US) + 1) for hook in HOOKS}
        """Calls per bucket (not cumulative): ``buckets[hook][i]`` took at most
        ``BUCKETS_US[i]`` and more than the bound before it."""

    def timed(self, hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its time added to ``hook``."""
        ns, cpu_ns, counts = self.ns, self.cpu_ns, self.buckets[hook]
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        bounds = tuple(b * 1_000 for b in BUCKETS_US)

        def timed_call(*args: Any) -> Any:
            start, cpu_start = clock(), cpu_clock()
            try:
                return fn(*args)
            finally:
                elapsed = clock() - start
                cpu_ns[hook] += cpu_clock() - cpu_start
                ns[hook] += elapsed
                counts[bisect_left(bounds, elapsed)] += 1

        return timed_call

    def summary(self) -> dict[str, dict[str, Any]]:
        return {hook: {"calls": sum(self.buckets[hook]), "us": self.ns[hook] / 1e3,
                       "cpu_us": self.cpu_ns[hook] / 1e3, "buckets": list(self.buckets[hook])}
                for hook in HOOKS}
