"""Other architectures on the GPU: a tiny random model of each of ``$DYNSTEER_GPU_ARCHS``
(default Gemma 3, Qwen3-MoE, Nemotron (dense) and OLMoE (mixture of experts), the last two
placed by their layers' contract; names of ``tiny_models.ARCHITECTURES``)
under CUDA graphs: static steering at every hook and phase and the gating cases (the Triton
kernel at the monitor sites) against HF, global steering set then cleared, FULL graphs replayed
and none captured after startup (where vLLM picks its V2 runner for the model)."""

from __future__ import annotations

import os

import pytest
from engine_checks import (
    ENGINE_OPTIONS,
    GPU,
    assert_gating,
    assert_global,
    assert_graphs,
    assert_static,
    gating_check,
    global_check,
    hf_bound,
    static_check,
)
from replays import replays

pytestmark = pytest.mark.engine

ARCHS = os.environ.get("DYNSTEER_GPU_ARCHS", "gemma3,qwen3_moe,nemotron,olmoe").split(",")


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_steers_as_hf_does_under_graphs(tiny_model_dir, arch: str) -> None:
    from engine_utils import start_llm, stop_llm
    from hf_reference import load_hf
    from test_gating_reference import MONITOR_SITES

    from dynsteer.engine_ext import Steering

    path = tiny_model_dir(arch)
    hf = load_hf(path)
    llm = start_llm(path, dynsteer={**ENGINE_OPTIONS, "monitor_sites": MONITOR_SITES}, **GPU)
    try:
        before = replays(llm)
        static, _ = static_check(llm, hf)
        steering = Steering(llm)
        gating = gating_check(llm, hf, steering)
        cleared = global_check(llm, steering)
        after = replays(llm)
    finally:
        stop_llm(llm)
    assert_static(static)
    assert_gating(gating, hf_bound(static))
    assert_global(cleared)
    assert_graphs(before, after)
