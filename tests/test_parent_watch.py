"""The parent watch (``DYNSTEER_EXIT_WITH_PARENT``) without vLLM: a multiprocessing child, and
the grandchild it starts, exit once the child's parent is killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dynsteer.engine_ext import parent_watch
from dynsteer.engine_ext.server.cli import prepare

# The parent: starts a multiprocessing child (spawn or fork), which calls the plugin's register()
# as vLLM would, then starts a grandchild (vLLM's workers); both only print their pid and sleep.
PARENT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time

    def grandchild():
        print("grandchild", os.getpid(), flush=True)
        time.sleep(600)

    def child(method):
        if method == "spawn":
            from dynsteer.engine_ext.plugin import register
            register()
        p = mp.get_context(method).Process(target=grandchild)
        p.start()
        print("child", os.getpid(), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        method = sys.argv[1]
        os.environ["DYNSTEER_DISABLE"] = "1"  # the watch alone, no patches (no torch import)
        from dynsteer.engine_ext.plugin import register
        register()  # the API server's call: must not watch the parent of this process
        mp.get_context(method).Process(target=child, args=(method,)).start()
        time.sleep(600)
""")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path: Path, method: str, env_value: str | None):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {k: v for k, v in os.environ.items() if k != parent_watch.ENV}
    if env_value is not None:
        env[parent_watch.ENV] = env_value
    proc = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    pids, other = {}, []
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()  # read apart, so a lost line fails, not hangs
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while len(pids) < 2:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            raise AssertionError(f"no pid line in 120 s; the script printed {other!r}") from None
        match = re.fullmatch(r"(child|grandchild) (\d+)", line.strip())
        if match is None:  # not the script's own line (CI once read one): kept to show
            other.append(line)
            continue
        pids[match[1]] = int(match[2])
    return proc, pids


def _kill_all(proc: subprocess.Popen, pids: dict[str, int]) -> None:
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_exit_when_parent_is_killed(tmp_path, method):
    proc, pids = _start(tmp_path, method, "1")
    try:
        time.sleep(0.5)
        assert _running(proc.pid), "the top process must not watch its own parent"
        proc.kill()  # kill -9 of the "API server"
        proc.wait()
        deadline = time.monotonic() + 15
        while any(map(_running, pids.values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = {name: pid for name, pid in pids.items() if _running(pid)}
        assert not alive, f"orphans after kill -9 of their parent: {alive}"
    finally:
        _kill_all(proc, pids)


def test_nothing_happens_without_the_variable(tmp_path):
    proc, pids = _start(tmp_path, "spawn", None)
    try:
        proc.kill()
        proc.wait()
        time.sleep(3 * parent_watch.POLL_S + 0.5)
        assert all(map(_running, pids.values())), "the watch ran without being asked for"
    finally:
        _kill_all(proc, pids)


def test_descendants_lists_the_whole_tree():
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := parent_watch.descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert all(_running(pid) for pid in found)
        assert os.getpid() not in found and proc.pid in parent_watch.descendants(os.getpid())
    finally:
        for pid in parent_watch.descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_serve_asks_for_it_unless_told_otherwise():
    env: dict[str, str] = {}
    prepare(["/m"], env)
    assert parent_watch.enabled(env)
    env = {parent_watch.ENV: "0"}
    prepare(["/m"], env)
    assert not parent_watch.enabled(env)
