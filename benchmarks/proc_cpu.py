"""CPU time per thread of a process tree, and the machine's busy cores, over a measured window.

Why: in session 28 every host operation of the plugin's engine core ran 1.4-2x slower than
stock's on the same step (the same vLLM calls, the same counts: ``mixed_steps.py``'s profile,
``serving.py``'s py-spy stacks), as if the engine core's thread shared its core. py-spy sees only
Python threads; a thread that spins in C (an OpenMP or BLAS pool after a parallel call, a
polling I/O thread) shows up here, by its kernel name, with the seconds it burned. Beside it,
each thread's run-queue wait (``/proc/.../schedstat``: runnable but not on a core) tells a thread
that shares its core (contention) from one on a slower core (no wait, less work per second),
and :func:`process_facts` gives what bounds the process's threads (affinity, torch's pools).
:class:`Placement` samples, during the window, which core each running thread is on, how busy
that core's SMT siblings are and the core's clock: session 30 saw plain vLLM's engine core
switch from 12 to 17 ms of host time per admitting step halfway through a trace, with the same
work, which is what a sibling's load or a clock change would do. Session 37 saw it again (every
host operation of the plugin's engine core 1.5-1.7x longer in the first seconds after its start,
the same calls, no run-queue wait), so a window also records two causes that fit: steal (the
lent machines are VMs; a virtual CPU whose host core runs something else is slower at
everything, and the guest sees no wait: the placement samples each CPU's steal share), and
memory placement (each process's page faults in the window and, at its end, its resident pages
per NUMA node, :func:`memory_facts`: memory on another node than the cores a process runs on
slows everything until the kernel's NUMA balancing, if on, moves the pages).
Linux only (``/proc``); elsewhere the snapshots are empty.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stacks import process_label

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    """(comm, fields after it) of a ``/proc/.../stat`` file; None when it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    open_, close = text.index("("), text.rindex(")")
    return text[open_ + 1:close], text[close + 2:].split()


def tree(root: int) -> list[int]:
    """``root`` and every descendant process."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.glob("[0-9]*"):
        parsed = _stat_fields(entry / "stat")
        if parsed is not None:
            children.setdefault(int(parsed[1][1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def label(pid: int) -> str:
    """The process's name as :func:`stacks.process_label` gives it (engine-core, api-server)."""
    try:
        argv = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    return process_label(" ".join(a.decode(errors="replace") for a in argv if a))


def process_key(pid: int) -> str:
    """``label/pid``: how a window's results name a process."""
    return f"{label(pid)}/{pid}"


def _thread_name(label: str, pid: int, tid: int, comm: str) -> str:
    """``label/name/tid``: Python threads carry the process's kernel name, so the main thread
    is told apart as ``main``."""
    return f"{label}/{'main' if tid == pid else comm}/{tid}"


def _wait_s(task: Path) -> float:
    """Seconds ``task`` has been runnable without a core (second field of ``schedstat``; 0
    where the kernel keeps no schedstats)."""
    try:
        return int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def snapshot(pids: list[int]) -> dict[tuple[int, int], tuple[str, str, float, float]]:
    """Per (pid, tid): (process label, thread name, CPU seconds so far (user + system),
    run-queue wait seconds so far)."""
    out = {}
    for pid in pids:
        name = label(pid)
        for task in (_PROC / str(pid) / "task").glob("[0-9]*"):
            parsed = _stat_fields(task / "stat")
            if parsed is not None:
                comm, fields = parsed
                out[(pid, int(task.name))] = (name, comm,
                                              (int(fields[11]) + int(fields[12])) / _TICK,
                                              _wait_s(task))
    return out


def process_facts() -> dict[str, Any]:
    """What bounds this process's threads: the cores it may run on, torch's intra- and
    inter-op pools and the environment that sizes them, and its threads by kernel name."""
    import collections

    import torch

    names = collections.Counter(parsed[0] for task in (_PROC / "self" / "task").glob("[0-9]*")
                                if (parsed := _stat_fields(task / "stat")) is not None)
    return {"affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None,
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                               "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY")
                    if k in os.environ},
            "threads_by_name": dict(names.most_common())}


def _stat_ticks() -> dict[int, tuple[int, int, int]]:
    """(non-idle, all, steal) ticks so far from ``/proc/stat``: per CPU, and the machine's
    total under -1 (its ``cpu`` line). Steal is time the hypervisor ran something else while
    the virtual CPU had work: a thread on such a CPU runs slower with no run-queue wait."""
    out = {}
    try:
        lines = (_PROC / "stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if line.startswith("cpu"):
            name, *rest = line.split()
            values = [int(v) for v in rest]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            steal = values[7] if len(values) > 7 else 0
            out[int(name[3:]) if name[3:] else -1] = (sum(values) - idle, sum(values), steal)
    return out


def _siblings(cpu: int) -> list[int]:
    """The other hardware threads of ``cpu``'s core (none where the topology is not given)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return [c for c in cpu_list(path.read_text()) if c != cpu]
    except OSError:
        return []


def cpu_list(text: str) -> list[int]:
    """The CPUs of a kernel CPU list such as ``0-3,8,10-11``."""
    found: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            found.extend(range(int(first), int(last or first) + 1))
    return found


def _clocks_mhz() -> dict[int, float]:
    """Each CPU's current clock (``/proc/cpuinfo``; a VM may report a constant)."""
    out, cpu = {}, None
    try:
        lines = (_PROC / "cpuinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpu = int(value)
        elif key == "cpu MHz" and cpu is not None:
            out[cpu] = float(value)
    return out


class Placement:
    """Samples, every ``period`` seconds on a thread of its own, each running thread of the
    given processes: the CPU it is on (``/proc/.../stat`` field 39), the busy share of that
    CPU's SMT siblings over the last period (by any process), the CPU's clock and its steal
    share over the last period. ``result`` (after :meth:`stop`): per thread with at least 5
    samples running, the samples, the CPUs it ran on (sample counts), the mean sibling busy
    share, the mean clock and the mean steal share of the CPUs it ran on."""

    def __init__(self, pids: list[int], period: float = 0.1) -> None:
        import threading

        self.labels, self.period = {pid: label(pid) for pid in pids}, period
        self.result: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="placement", daemon=True)
        self._samples: dict[str, list[tuple[int, float, float, float]]] = {}
        self._sibling_cache: dict[int, list[int]] = {}

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        last = _stat_ticks()
        while not self._stop.wait(self.period):
            now, clocks = _stat_ticks(), _clocks_mhz()
            share = {c: (b - last[c][0]) / max(1, t - last[c][1])
                     for c, (b, t, _) in now.items() if c in last}
            stolen = {c: (st - last[c][2]) / max(1, t - last[c][1])
                      for c, (_, t, st) in now.items() if c in last}
            last = now
            for pid, label in self.labels.items():
                for task in (_PROC / str(pid) / "task").glob("[0-9]*"):
                    parsed = _stat_fields(task / "stat")
                    if parsed is None or parsed[1][0] != "R":
                        continue
                    comm, fields = parsed
                    cpu = int(fields[36])
                    siblings = self._sibling_cache.setdefault(cpu, _siblings(cpu))
                    busy = (sum(share.get(c, 0.0) for c in siblings) / len(siblings)
                            if siblings else 0.0)
                    name = _thread_name(label, pid, int(task.name), comm)
                    self._samples.setdefault(name, []).append(
                        (cpu, busy, clocks.get(cpu, 0.0), stolen.get(cpu, 0.0)))

    def stop(self) -> None:
        import collections

        self._stop.set()
        self._thread.join()
        for name, samples in sorted(self._samples.items(), key=lambda kv: -len(kv[1])):
            if len(samples) < 5:
                continue
            cpus = collections.Counter(sample[0] for sample in samples)
            self.result[name] = {
                "samples": len(samples), "cpus": dict(cpus.most_common()),
                "sibling_busy": round(sum(s[1] for s in samples) / len(samples), 3),
                "mhz": round(sum(s[2] for s in samples) / len(samples), 1),
                "steal": round(sum(s[3] for s in samples) / len(samples), 3)}


def numa_nodes() -> dict[int, list[int]]:
    """The machine's NUMA nodes and their CPUs (``/sys/devices/system/node``)."""
    out = {}
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        try:
            out[int(node.name[4:])] = cpu_list((node / "cpulist").read_text())
        except OSError:
            continue
    return dict(sorted(out.items()))


def numa_pages(pid: int) -> dict[int, int]:
    """Resident pages of process ``pid`` per NUMA node (the ``N<node>=<pages>`` fields of
    ``/proc/<pid>/numa_maps``); empty where the file is missing or unreadable."""
    out: dict[int, int] = {}
    try:
        text = (_PROC / str(pid) / "numa_maps").read_text()
    except OSError:
        return out
    for token in text.split():
        if token.startswith("N") and "=" in token:
            node, _, pages = token[1:].partition("=")
            if node.isdigit() and pages.isdigit():
                out[int(node)] = out.get(int(node), 0) + int(pages)
    return dict(sorted(out.items()))


def huge_pages(pid: int) -> dict[str, int]:
    """Resident and anonymous-huge-page kB of process ``pid`` (``/proc/<pid>/smaps_rollup``):
    with transparent huge pages on, the kernel collapses a process's memory into huge pages
    over minutes, and its code runs faster as TLB misses fall; empty where unreadable."""
    out = {}
    try:
        lines = (_PROC / str(pid) / "smaps_rollup").read_text().splitlines()
    except OSError:
        return out
    names = {"Rss": "rss_kb", "AnonHugePages": "anon_huge_kb"}
    for line in lines:
        key, _, value = line.partition(":")
        if key in names and value.split():
            out[names[key]] = int(value.split()[0])
    return out


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of process ``pid`` so far; (0, 0) when it is gone."""
    parsed = _stat_fields(_PROC / str(pid) / "stat")
    return (int(parsed[1][7]), int(parsed[1][9])) if parsed is not None else (0, 0)


def memory_facts(pids: list[int], before: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """Per process (``label/pid``): page faults since ``before`` (:func:`_faults` per pid), its
    resident pages per NUMA node now and its huge pages (:func:`huge_pages`); the nodes'
    CPUs, whether the kernel balances pages between nodes (``numa_balancing``) and its
    transparent-huge-page mode."""
    processes = {}
    for pid in pids:
        minor, major = _faults(pid)
        minor0, major0 = before.get(pid, (minor, major))
        processes[process_key(pid)] = {"minor_faults": minor - minor0,
                                       "major_faults": major - major0,
                                       "pages_by_node": numa_pages(pid),
                                       **huge_pages(pid)}
    return {"nodes": numa_nodes(), "numa_balancing": _read("/proc/sys/kernel/numa_balancing"),
            "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "processes": processes}


def busy_ticks() -> tuple[float, float, float]:
    """(non-idle, all, steal) CPU seconds of the machine so far, over every core
    (``/proc/stat``)."""
    busy, total, steal = _stat_ticks().get(-1, (0, 0, 0))
    return busy / _TICK, total / _TICK, steal / _TICK


class Window:
    """CPU seconds spent inside a ``with`` block by each thread (``label/name/tid``; ``main``
    for a process's main thread) of the processes of ``root``'s tree (default: this process),
    busiest first; and the machine's busy cores on average. A thread (or process) that exits
    inside the block is not counted: the window reads each thread's total at its two ends.
    ``memory``: :func:`memory_facts` of the processes (read after the block's end time is
    taken: walking a large process's page tables is not counted in ``seconds``)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Window:
        import time

        self._pids = tree(self.root)
        self._placement = Placement(self._pids)
        self._placement.start()
        self._before = snapshot(self._pids)
        self._faults = {pid: _faults(pid) for pid in self._pids}
        self._busy = busy_ticks()
        self._t = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        seconds = time.monotonic() - self._t
        after = snapshot(self._pids)
        busy = busy_ticks()
        self._placement.stop()
        threads: dict[str, float] = {}
        waits: dict[str, float] = {}
        for (pid, tid), (label, comm, cpu, wait) in after.items():
            _, _, cpu0, wait0 = self._before.get((pid, tid), (label, comm, 0.0, 0.0))
            name = _thread_name(label, pid, tid, comm)
            threads[name], waits[name] = cpu - cpu0, wait - wait0
        top = sorted(threads.items(), key=lambda kv: -kv[1])
        self.result = {
            "seconds": seconds,
            "threads_cpu_s": {name: round(s, 3) for name, s in top if s > 0},
            "threads_wait_s": {name: round(waits[name], 4) for name, s in top if s > 0},
            "machine_busy_cores": (busy[0] - self._busy[0]) / seconds if seconds else 0.0,
            "machine_steal_share": ((busy[2] - self._busy[2]) / (busy[1] - self._busy[1])
                                    if busy[1] > self._busy[1] else 0.0),
            "machine_cores": os.cpu_count(),
            "placement": self._placement.result,
            "memory": memory_facts(self._pids, self._faults),
        }


def describe(result: dict[str, Any], top: int = 8) -> str:
    if not result:
        return "no CPU window"
    waits = result.get("threads_wait_s", {})
    threads = ", ".join(f"{name} {s:.2f}s (waited {waits.get(name, 0.0):.3f}s)"
                        for name, s in list(result["threads_cpu_s"].items())[:top])
    placed = "; ".join(
        f"{name} on CPUs {list(p['cpus'])[:4]}, siblings {p['sibling_busy']:.0%} busy, "
        f"{p['mhz']:.0f} MHz, {p.get('steal', 0.0):.0%} stolen"
        for name, p in list(result.get("placement", {}).items())[:2])
    memory = "; ".join(
        f"{name} {m['minor_faults']} minor / {m['major_faults']} major faults, pages by node "
        f"{m['pages_by_node']}, {m.get('anon_huge_kb', 0) >> 10} of {m.get('rss_kb', 0) >> 10}"
        " MiB in huge pages"
        for name, m in result.get("memory", {}).get("processes", {}).items()
        if name.startswith(("engine-core", "api-server")))
    return (f"{result['seconds']:.1f} s window, machine {result['machine_busy_cores']:.1f} of "
            f"{result['machine_cores']} cores busy; threads: {threads}"
            + (f"; placement: {placed}" if placed else "")
            + (f"; memory: {memory}" if memory else ""))
