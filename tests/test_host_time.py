"""The worker hooks' timer: wall time, the thread's CPU time and the histogram of calls."""

from __future__ import annotations

import threading
import time

from dynsteer.engine_ext.worker.host_time import BUCKETS_US, HostTime


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_busy_hook_counts_cpu_and_sleeping_hook_does_not():
    timer = HostTime()
    timer.timed("step", _spin)(0.03)
    timer.timed("output", time.sleep)(0.03)
    summary = timer.summary()
    step, output = summary["step"], summary["output"]
    assert step["calls"] == output["calls"] == 1
    assert step["us"] >= 30_000 and output["us"] >= 30_000
    assert step["cpu_us"] > 0.3 * step["us"]  # loose: CI shares its cores
    assert output["cpu_us"] < 0.2 * output["us"]
    assert summary["admit"] == {"calls": 0, "us": 0.0, "cpu_us": 0.0,
                                "buckets": [0] * (len(BUCKETS_US) + 1)}


def test_time_waiting_for_the_gil_is_wall_time_not_cpu_time():
    """A hook that releases the GIL while another thread runs Python waits to get it back
    (at least the interpreter's switch interval): what the engine core's I/O threads cost a
    hook that makes torch calls."""
    started, stop = threading.Event(), threading.Event()

    def python_loop() -> None:
        started.set()
        while not stop.is_set():
            sum(range(1000))

    other = threading.Thread(target=python_loop, daemon=True)
    other.start()
    started.wait()
    timer = HostTime()
    try:
        hook = timer.timed("step", lambda: [time.sleep(0) for _ in range(5)])
        hook()
    finally:
        stop.set()
        other.join()
    step = timer.summary()["step"]
    assert step["us"] - step["cpu_us"] > 2_000, step


def test_calls_land_in_their_buckets():
    timer = HostTime()
    hook = timer.timed("admit", lambda seconds: time.sleep(seconds))
    hook(0)
    hook(0.012)
    buckets = timer.summary()["admit"]["buckets"]
    assert sum(buckets) == 2
    assert buckets[BUCKETS_US.index(20_000)] == 1 or buckets[BUCKETS_US.index(50_000)] == 1
