"""Shared fixtures: tiny models on disk (one per architecture per session), the HF reference
model of the tiny Llama, and the tiny chat model a `dynsteer serve` test serves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(arch)`` -> path of a tiny random model (built once per session)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir):
    """The tiny Llama in HF transformers (the reference of ``hf_reference``)."""
    from hf_reference import load_hf  # on use: unit-test runs need neither helper module

    return load_hf(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with the embedded model's tokenizer and chat template (see
    ``server_utils.make_chat_model``)."""
    from server_utils import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("chat_model"))
