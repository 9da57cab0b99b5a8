"""Garbage-collector pauses of every Python process started with this folder on ``PYTHONPATH``
and ``DYNSTEER_BENCH_GC_LOG`` set to a folder (``serving.py --gc-log``; a benchmark aid, not
part of the plugin).

Why: the plugin's server has tail steps (15-20 ms inter-token gaps that plain vLLM's does not
have, session 38) that a collection of the oldest generation would explain: vLLM freezes the
heap after start-up, so every object made later is scanned again by each full collection.
Each process keeps, per generation, the collections, their total and longest pause, and
writes them (cumulative, with its pid and kernel name) to ``DIR/gc_<pid>.json`` at the end of
a collection, at most once a second, so a reader diffs two snapshots of a window (at most a
second stale). The callback's own cost is two clock reads per collection.
"""

import gc
import json
import os
import time

_DIR = os.environ.get("DYNSTEER_BENCH_GC_LOG")


def _install(folder: str) -> None:
    stats = {"pid": 0, "count": [0, 0, 0], "ns": [0, 0, 0], "max_ns": [0, 0, 0]}
    clock = {"start": 0, "written": 0}

    def callback(phase: str, info: dict) -> None:
        now = time.perf_counter_ns()
        if phase == "start":
            clock["start"] = now
            return
        if stats["pid"] != os.getpid():  # a forked child starts its own counts
            stats.update(pid=os.getpid(), count=[0, 0, 0], ns=[0, 0, 0], max_ns=[0, 0, 0])
        generation, pause = info["generation"], now - clock["start"]
        stats["count"][generation] += 1
        stats["ns"][generation] += pause
        stats["max_ns"][generation] = max(stats["max_ns"][generation], pause)
        if now - clock["written"] < 1_000_000_000:
            return
        clock["written"] = now
        try:
            with open(f"/proc/{stats['pid']}/comm") as comm:
                name = comm.read().strip()
            path = os.path.join(folder, f"gc_{stats['pid']}.json")
            with open(path + ".tmp", "w") as out:
                json.dump({**stats, "name": name, "time": time.time()}, out)
            os.replace(path + ".tmp", path)
        except OSError:
            pass

    os.makedirs(folder, exist_ok=True)
    gc.callbacks.append(callback)


if _DIR:
    _install(_DIR)
