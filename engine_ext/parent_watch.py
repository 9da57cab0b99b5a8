"""Engine processes exit when the process that started them dies (``DYNSTEER_EXIT_WITH_PARENT``).

Why: vLLM's API server starts an EngineCore process (``multiprocessing``, spawn or fork), which
starts the worker processes. The workers watch the EngineCore (a "death pipe" in
``vllm/v1/executor/multiproc_executor.py``), but nothing in the EngineCore
(``EngineCoreProc.run_engine_core`` in ``vllm/v1/engine/core.py``) watches the API server: it
only exits on SIGTERM/SIGINT, which the API server sends from its own shutdown path. After a
``kill -9`` of the API server (or an OOM kill) that path never runs, so the EngineCore and with it
the workers, holding the model and the KV cache, run on as orphans.

What: with ``DYNSTEER_EXIT_WITH_PARENT=1`` in the environment (``dynsteer serve`` sets it; it
works under a plain ``vllm serve`` with ``VLLM_PLUGINS=dynsteer`` too), every process that
multiprocessing started (``multiprocessing.parent_process()`` is set) runs a daemon thread that
checks ``os.getppid()`` every :data:`POLL_S` seconds. Once the parent is gone (the process was
reparented), it SIGKILLs its own descendants, then itself. The top process (the API server) is
never watched, so ``nohup dynsteer serve &`` still outlives its shell. The thread is started from
the plugin's ``register()``, which vLLM calls in the EngineCore and in every worker, and again
after ``os.fork()`` (vLLM forks instead of spawning where CUDA is not initialised yet; a forked
child inherits the "plugins loaded" flag, so ``register()`` is not called there again).

Why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that created the child exits,
not the process, so a child started from a short-lived thread would be killed early; and it is
not inherited across fork. Why not ``multiprocessing.parent_process().sentinel``: it only reads
EOF once every copy of the parent's pipe end is closed, and a process forked by the parent keeps
one. Polling ``getppid()`` costs one system call per half second and has neither problem.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Mapping

ENV = "DYNSTEER_EXIT_WITH_PARENT"
POLL_S = 0.5

_watched_in: int | None = None  # pid of the process whose watcher thread runs
_fork_hook_installed = False
_pid_before_fork: int | None = None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Start the watcher if asked for and this is a multiprocessing child (idempotent, cheap)."""
    global _fork_hook_installed
    if not enabled():
        return
    if not _fork_hook_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_installed = True
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        watch(parent.pid)


def watch(parent_pid: int) -> None:
    """Exit (with every descendant) once ``parent_pid`` is no longer this process's parent."""
    global _watched_in
    if _watched_in == os.getpid():
        return
    _watched_in = os.getpid()
    threading.Thread(target=_watch_loop, args=(parent_pid,), name="dynsteer-parent-watch",
                     daemon=True).start()


def _before_fork() -> None:
    global _pid_before_fork
    _pid_before_fork = os.getpid()


def _after_fork_in_child() -> None:
    # Threads do not survive fork(); the parent's pid was saved just before it, since getppid()
    # here would already say 1 if the parent died in between.
    if enabled() and _pid_before_fork is not None:
        watch(_pid_before_fork)


def _watch_loop(parent_pid: int) -> None:
    stop = threading.Event()  # never set: a sleep that a daemon thread can be torn down in
    while os.getppid() == parent_pid:
        stop.wait(POLL_S)
    _exit_with_descendants(parent_pid)


def _exit_with_descendants(parent_pid: int) -> None:
    me = os.getpid()
    with contextlib.suppress(Exception):  # a closed stream must not stop the exit
        sys.stderr.write(f"dynsteer: parent process {parent_pid} of pid {me} exited; "
                         "killing this process and its children\n")
        sys.stderr.flush()
    # Twice: a child forked while the first round ran is caught by the second.
    for _ in range(2):
        for pid in descendants(me):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
