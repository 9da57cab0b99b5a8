"""Run `dynsteer serve` as a child process (tests, demos, notebooks); no vLLM import here.

    with ServerProcess(["MODEL", "--port", "8000"]) as server:
        server.wait_ready()
        DynsteerClient(server.url).info()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`dynsteer serve ARGS` on 127.0.0.1 (a free port unless ``--port`` is given)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        if "--port" not in args:
            args = [*args, "--port", str(free_port())]
        if "--host" not in args:
            args = [*args, "--host", "127.0.0.1"]
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self._log_file: IO[bytes] = open(self.log, "wb")  # noqa: SIM115  (closed in stop())
        cmd = [sys.executable, "-m", "dynsteer.engine_ext.cli", "serve", *args]
        # Its own session and process group: a signal meant for the caller's group (Ctrl-C in a
        # terminal) does not reach the engine processes directly, so they exit only when the
        # server does, as they would in production (a kill -9 of the server included).
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float = 600.0,
                   on_wait: Callable[[str], None] | None = None,
                   api_key: str | None = None) -> None:
        """Block until ``/v1/dynsteer/health`` answers 200; raise with the log tail if the
        server exits or does not come up in ``timeout`` seconds. ``on_wait`` is called about
        every 2 s with the log's last line (what the server is doing, for a progress bar).
        ``api_key``: one of vLLM's ``--api-key`` keys, which guard ``/v1`` routes."""
        request = urllib.request.Request(self.url + "/v1/dynsteer/health")
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if on_wait is not None:
                on_wait(self.log_tail(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynsteer serve exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(request, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"dynsteer serve not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 60 s."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
