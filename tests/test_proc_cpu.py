"""benchmarks/proc_cpu.py: a thread that burns CPU inside the window is found (by its thread id),
an idle one is not, and a child process's CPU is counted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from proc_cpu import Window, cpu_list, describe, tree

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")


def _spin(until: threading.Event) -> None:
    while not until.is_set():
        pass


def test_a_spinning_thread_is_found_and_an_idle_one_is_not():
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="idle-waiter", daemon=True)
    idle.start()
    worker = threading.Thread(target=_spin, args=(stop,), daemon=True)
    worker.start()
    with Window() as window:  # the spinner runs from before the window to after it
        time.sleep(1.0)
    stop.set()
    worker.join()
    threads = window.result["threads_cpu_s"]
    mine = {name: s for name, s in threads.items() if name.endswith(f"/{worker.native_id}")}
    assert len(mine) == 1 and next(iter(mine.values())) >= 0.5, threads
    assert next(iter(threads)) == next(iter(mine))  # busiest first
    assert sum(s for name, s in threads.items() if name.endswith(f"/{idle.native_id}")) < 0.05
    assert window.result["machine_busy_cores"] > 0.5
    assert str(worker.native_id) in describe(window.result)


def test_a_live_child_burning_cpu_is_counted():
    """This process sleeps through the window while its child spins: the CPU counted is the
    child's."""
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.monotonic() + 3\n"
                              "while time.monotonic() < end: pass"])
    try:
        time.sleep(0.3)
        assert child.pid in tree(os.getpid())
        with Window() as window:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    assert sum(window.result["threads_cpu_s"].values()) >= 0.5, window.result


_TWO_ON_ONE_CORE = """
import os, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.fork()  # two spinners on one core: each is runnable about half the time without it
end = time.monotonic() + 3
while time.monotonic() < end:
    pass
"""


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs schedstats")
def test_threads_sharing_a_core_wait_for_it():
    child = subprocess.Popen([sys.executable, "-c", _TWO_ON_ONE_CORE])
    try:
        time.sleep(0.5)
        with Window(child.pid) as window:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    waits = window.result["threads_wait_s"]
    assert waits.keys() == window.result["threads_cpu_s"].keys()
    assert sum(waits.values()) >= 0.5, window.result  # about 1 s between the two
    assert "waited" in describe(window.result)


def test_process_facts_name_the_bounds():
    from proc_cpu import process_facts

    facts = process_facts()
    assert facts["affinity"] >= 1 and facts["torch_threads"] >= 1
    assert sum(facts["threads_by_name"].values()) >= 1


def test_placement_names_the_core_a_pinned_thread_ran_on():
    stop = threading.Event()
    cpu = max(os.sched_getaffinity(0))
    worker = threading.Thread(target=_spin, args=(stop,), daemon=True)
    worker.start()
    os.sched_setaffinity(worker.native_id, {cpu})
    with Window() as window:
        time.sleep(1.5)
    stop.set()
    worker.join()
    placed = {name: p for name, p in window.result["placement"].items()
              if name.endswith(f"/{worker.native_id}")}
    assert len(placed) == 1, window.result["placement"]
    (found,) = placed.values()
    assert found["cpus"] == {cpu: found["samples"]} and found["samples"] >= 5
    assert 0.0 <= found["sibling_busy"] <= 1.0 and 0.0 <= found["steal"] <= 1.0
    assert 0.0 <= window.result["machine_steal_share"] <= 1.0
    assert "placement:" in describe(window.result) and "stolen" in describe(window.result)


def test_stat_ticks_read_steal(tmp_path, monkeypatch):
    """``/proc/stat`` as a VM writes it: user nice system idle iowait irq softirq steal ...;
    idle and iowait are not busy, steal is busy and reported apart."""
    import proc_cpu

    (tmp_path / "stat").write_text("cpu  100 0 50 800 10 0 0 40 0 0\n"
                                   "cpu3 10 0 5 80 1 0 0 4 0 0\nintr 1 2 3\n")
    monkeypatch.setattr(proc_cpu, "_PROC", tmp_path)
    ticks = proc_cpu._stat_ticks()
    assert ticks == {-1: (190, 1000, 40), 3: (19, 100, 4)}


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_list("5") == [5] and cpu_list("") == []


def test_memory_facts_count_faults_and_pages_by_node():
    """Touching a fresh mapping inside the window shows as minor faults of this process (not
    memory malloc kept from earlier tests: that faults no more), its resident pages are placed
    on the machine's nodes (every node named has CPUs), and its resident size holds the
    block."""
    import mmap

    import proc_cpu

    block = mmap.mmap(-1, 64 << 20)  # a fresh mapping: its pages fault in when touched
    with Window() as window:
        for page in range(0, len(block), 4096):  # 16384 pages of 4 KiB
            block[page] = 1
    block.close()
    memory = window.result["memory"]
    mine = memory["processes"][next(k for k in memory["processes"]
                                    if k.endswith(f"/{os.getpid()}"))]
    assert mine["minor_faults"] >= 32, mine  # one per page, or per 2 MiB where THP maps it
    assert mine["major_faults"] >= 0
    nodes = memory["nodes"]
    if Path("/proc/self/numa_maps").exists() and nodes:
        assert set(mine["pages_by_node"]) <= set(nodes)
        assert sum(mine["pages_by_node"].values()) >= 16384
        assert all(nodes.values())
    assert memory["numa_balancing"] in (None, "0", "1", "2", "3")
    if Path("/proc/self/smaps_rollup").exists():
        assert mine["rss_kb"] >= 64 << 10 and 0 <= mine["anon_huge_kb"] <= mine["rss_kb"]
    assert memory["transparent_hugepage"] is None or "[" in memory["transparent_hugepage"]
    assert proc_cpu.numa_pages(2 ** 22 + 12345) == {}  # no such process


def test_describe_names_the_servers_memory():
    """The printed line carries the engine core's faults, pages by node and huge pages (and
    leaves other processes of the tree out)."""
    result = {"seconds": 2.0, "machine_busy_cores": 1.5, "machine_cores": 16,
              "threads_cpu_s": {"engine-core/main/7": 1.2}, "threads_wait_s": {},
              "memory": {"processes": {
                  "engine-core/7": {"minor_faults": 120, "major_faults": 3,
                                    "pages_by_node": {0: 1000, 1: 24},
                                    "rss_kb": 4 << 20, "anon_huge_kb": 1 << 20},
                  "launcher/5": {"minor_faults": 9, "major_faults": 0, "pages_by_node": {}}}}}
    line = describe(result)
    assert ("memory: engine-core/7 120 minor / 3 major faults, pages by node {0: 1000, 1: 24}, "
            "1024 of 4096 MiB in huge pages") in line
    assert "launcher" not in line
