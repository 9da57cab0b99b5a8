"""Shared fixtures: tiny models on disk (one per architecture per session)."""

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
