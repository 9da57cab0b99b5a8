"""The prefix guard on the GPU, with async scheduling on (the next step is scheduled before this
step's output is processed; the CPU build forces it off, so CI covers the synchronous path):
every test of ``test_prefix_cache.py``, collected here and run against a CUDA engine with that
module's engine options. Steered requests never hit blocks computed under other steering,
identically steered ones share, a gated conversation is served from its own blocks, a gate under
a controller caches only the blocks before its first dynamic position, unsteered traffic keeps
full hits; each reuse checked against HF.

``VLLM_USE_V2_MODEL_RUNNER=0`` runs the same on vLLM's V1 runner."""

from __future__ import annotations

from typing import Any

import pytest
import test_prefix_cache
from test_prefix_cache import BLOCK, DYNSTEER

pytestmark = pytest.mark.engine

globals().update({name: test for name, test in vars(test_prefix_cache).items()
                  if name.startswith("test_") and callable(test)})


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> Any:
    """``test_prefix_cache.py``'s engine on CUDA, with async scheduling."""
    from engine_utils import start_llm, stop_llm

    llm = start_llm(tiny_model_dir("llama"), dynsteer=DYNSTEER, enable_prefix_caching=True,
                    block_size=BLOCK, gpu_memory_utilization=0.25, async_scheduling=True)
    try:
        yield llm
    finally:
        stop_llm(llm)


def test_async_scheduling_is_on(llm) -> None:
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
