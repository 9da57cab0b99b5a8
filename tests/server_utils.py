"""Starting a real `dynsteer serve` (CPU vLLM) on loopback for tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tiny_models import make_tiny_model

STARTUP_TIMEOUT_S = 420


def make_chat_model(path: Path, tokenizer_dir: Path | None = None) -> Path:
    """A tiny random Llama with the embedded model's tokenizer and chat template (or the
    tokenizer files in ``tokenizer_dir``)."""
    make_tiny_model("llama", path, vocab=49152)
    if tokenizer_dir is None:
        from dynsteer.engine_ext.model_cache import default_model_path

        tokenizer_dir = default_model_path()
    source = tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `dynsteer serve` subprocess; its log is kept for failure messages."""

    def __init__(self, model: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        cmd = [sys.executable, "-m", "dynsteer.engine_ext.cli", "serve", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0", *extra]
        if os.environ.get("DYNSTEER_TEST_GPU_MEMORY"):
            cmd += ["--gpu-memory-utilization", os.environ["DYNSTEER_TEST_GPU_MEMORY"]]
        self._log_file = open(log, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynsteer serve exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/dynsteer/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"dynsteer serve not ready in {STARTUP_TIMEOUT_S} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def http(method: str, url: str, body: Any = None, *, raw: bytes | None = None,
         api_key: str | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; never raises on HTTP errors."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")
