"""Starting a real `dynsteer serve` (CPU vLLM) on loopback for tests."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
from engine_utils import WITHOUT_INDUCTOR, refuse_in_fast_lane, without_inductor
from tiny_models import make_tiny_model

from dynsteer.controller.launch import ServerProcess


def make_chat_model(path: Path, tokenizer_dir: Path | None = None) -> Path:
    """A tiny random Llama with the embedded model's tokenizer and chat template (or the
    tokenizer files in ``tokenizer_dir``)."""
    make_tiny_model("llama", path, vocab=49152)
    if tokenizer_dir is None:
        from dynsteer.engine_ext.default_model import default_model_path

        tokenizer_dir = default_model_path()
    source = tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    return path


STARTUP_TIMEOUT_S = 420


class Server(ServerProcess):
    """`dynsteer serve MODEL` for tests: the tiny model's settings, fp32, seed 0; its engine
    compiled without Inductor unless ``inductor`` (``engine_utils.WITHOUT_INDUCTOR``)."""

    def __init__(self, model: Path, log: Path, *extra: str, inductor: bool = False) -> None:
        refuse_in_fast_lane()
        args = [str(model), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs",
                "8", "--seed", "0", *extra]
        if os.environ.get("DYNSTEER_TEST_GPU_MEMORY"):
            args += ["--gpu-memory-utilization", os.environ["DYNSTEER_TEST_GPU_MEMORY"]]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **({} if inductor else WITHOUT_INDUCTOR)}
        super().__init__(args, log, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S, api_key: str | None = None) -> None:
        super().wait_ready(timeout, api_key=api_key)


def http(method: str, url: str, body: Any = None, *, raw: bytes | None = None,
         api_key: str | None = None, timeout: float = 120) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; never raises on HTTP errors."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


SAFETY_ARTIFACTS = "safety-artifacts"
"""The ``--cache`` of the probe and refusal directions, one folder per test session: the tests
of the safety experiments (demo, steering, controllers) train them with the same arguments, so
the first of them to run trains them and the others load them."""


@contextmanager
def safety_experiment(tmp_path_factory: pytest.TempPathFactory,
                      inductor: bool = False) -> Iterator[list[str]]:
    """Settings for running a safety experiment's ``main`` in a test: the server's KV cache as
    every test server's, its engine compiled without Inductor unless ``inductor``
    (``engine_utils.WITHOUT_INDUCTOR``), and the arguments the three tests share (the session's
    artifact cache, float32, which is several times faster than bfloat16 on CPUs without
    bfloat16 instructions)."""
    with pytest.MonkeyPatch.context() as env, nullcontext() if inductor else without_inductor():
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield ["--cache", str(tmp_path_factory.getbasetemp() / SAFETY_ARTIFACTS),
               "--dtype", "float32"]
