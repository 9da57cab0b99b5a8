"""The GPU checks (H100 / H200, vLLM 0.26 from ``../shared/gpukit``, V2 runner, torch.compile and
FULL + PIECEWISE CUDA graphs): the compiled kernels against the references of the CPU tests, the
tiny models under graph replay against HF, serving and the prefix guard, and TP=2 / PP=2 against
one GPU. On the GPU host, from the project root (``benchmarks/README.md``)::

    source .gpukit/bin/env.sh && python -m pytest -q tests/gpu

Where CUDA is not available (the CPU suite, CI) every test here is collected and skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CUDA = torch.cuda.is_available()
SKIP = pytest.mark.skip(reason="needs CUDA (the GPU host: python -m pytest tests/gpu)")

if CUDA:
    # The test process holds CUDA (the kernels' tests, the HF references): engine processes it
    # starts cannot be forked from it.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # A function sent by ``collective_rpc`` (``replays.count_replays``) is pickled.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # ``server_utils.Server``'s share of the GPU (the offline engine beside it takes as much).
    os.environ.setdefault("DYNSTEER_TEST_GPU_MEMORY", "0.25")
    # Engine processes import that function's module from here (and the tests' helpers).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of this folder is marked ``gpu``, and skipped without CUDA (this hook sees
    every item of the session: only this folder's are touched)."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.gpu)
            if not CUDA:
                item.add_marker(SKIP)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model of ``server_utils.make_chat_model`` with the tokenizer files of
    ``$DYNSTEER_TOKENIZER`` (a folder: the GPU host cannot download the embedded default
    model), else of the default model where it is installed."""
    from server_utils import make_chat_model

    given = os.environ.get("DYNSTEER_TOKENIZER")
    if given:
        tokenizer = Path(given)
    else:
        try:
            from dynsteer.engine_ext.default_model import default_model_path

            tokenizer = default_model_path()
        except Exception as e:  # no model package on the GPU host
            pytest.skip(f"set DYNSTEER_TOKENIZER to a tokenizer folder ({e})")
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model", tokenizer)
