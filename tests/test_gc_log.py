"""``serving.py --gc-log``: a child started with gc_timing's sitecustomize reports its
collections, and :class:`gc_log.GcWindow` turns two snapshots into the window's counts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gc_log import GcWindow, describe, window

SITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gc_timing"

CHILD = """
import gc, sys, time
gc.collect()  # a collection before the window opens, written at once
print("ready", flush=True)
sys.stdin.readline()
for _ in range(3):
    time.sleep(1.05)  # files are written at most once a second
    gc.collect()
print("done", flush=True)
sys.stdin.readline()
"""


def test_window_counts_a_childs_collections(tmp_path: Path) -> None:
    env = {**os.environ, "DYNSTEER_BENCH_GC_LOG": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "ready"
        with GcWindow(child.pid, tmp_path) as gc_window:
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
        (name, got), = gc_window.result.items()
        assert name.endswith(f"/{child.pid}")
        assert got["count"][2] == 3  # the three full collections inside the window, not before
        assert got["ms"][2] > 0 and max(got["max_ms"]) > 0
        assert "gen0/1/2" in describe(gc_window.result)
    finally:
        child.stdin.close()
        child.wait(10)


def test_without_a_folder_nothing_is_read() -> None:
    with GcWindow(os.getpid(), None) as gc_window:
        time.sleep(0)
    assert gc_window.result == {}


def test_window_of_a_process_new_in_it() -> None:
    after = {7: {"count": [5, 1, 0], "ns": [2_000_000, 1_000_000, 0], "max_ns": [9, 9, 0]}}
    assert window({}, after, {7: "engine-core/7"}) == {
        "engine-core/7": {"count": [5, 1, 0], "ms": [2.0, 1.0, 0.0], "max_ms": [0.0, 0.0, 0.0]}}
