"""`dynsteer serve` never leaves orphans: after ``kill -9`` of the API server process, its
EngineCore and worker processes exit on their own (``engine_ext/parent_watch.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest
from server_utils import Server, make_chat_model

pytestmark = pytest.mark.engine

EXIT_TIMEOUT_S = 30.0


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie waiting for a reaper has exited)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def test_engine_processes_exit_after_kill_9_of_server(tmp_path):
    model = make_chat_model(tmp_path / "model")
    server = Server(model, tmp_path / "serve.log")
    descendants: list[psutil.Process] = []
    try:
        server.wait_ready()
        descendants = psutil.Process(server.proc.pid).children(recursive=True)
        assert descendants, "expected an EngineCore process under the server"
        print("descendants:", *_describe(descendants), sep="\n  ")

        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        alive = _wait_gone(descendants, EXIT_TIMEOUT_S)
        assert not alive, (f"orphans still running {EXIT_TIMEOUT_S:.0f} s after kill -9 of the "
                           f"server:\n" + "\n".join(_describe(alive))
                           + f"\n--- server log ---\n{server.log_tail()}")
    finally:
        # Never leave orphans on the test machine, whatever happened above.
        for p in descendants:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait_gone(descendants, 10)
        if server.proc.poll() is None:
            server.stop()
        else:
            server._log_file.close()
