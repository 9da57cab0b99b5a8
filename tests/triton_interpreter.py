"""Running a CUDA kernel's Triton code on the CPU, in Triton's interpreter (a subprocess:
the interpreter is chosen when Triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch


def run_interpreted(script: str) -> Any:
    """Run ``script`` (a ``str.format`` template: ``{tests}`` is this folder, braces doubled)
    with ``TRITON_INTERPRET=1`` and this folder on ``PYTHONPATH`` (the tests' modules import as
    they do here); returns the JSON it printed."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script.format(tests=tests)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def require_interpreter(on_gpu: str) -> None:
    """Skip unless Triton's CPU interpreter can run here: Triton is installed and there is no
    GPU (the GPU image's Triton 3.6 interpreter cannot run the kernels; ``on_gpu`` says what
    checks them compiled there instead)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip(f"on a GPU, {on_gpu}")
