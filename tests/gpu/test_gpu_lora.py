"""LoRA and steering in one batch on the GPU (CUDA graphs on): requests with the adapter and
requests without it, each with and without static steering, in the same ``generate`` call,
against HF transformers with the adapter merged (``peft``) or without it and the same steering
as hooks. The CPU build cannot run such a mixed batch (``tests/test_lora_steering.py``). Needs
``peft`` on the GPU host: ``make gpukit`` packs it.

vLLM's GPU LoRA kernels take float16 or bfloat16 weights only, so the engine runs in float16
against the float32 reference: the bound is twice the plain base request's own difference from
HF (at least 2e-3), and the adapter and the steering must each move logprobs by more than five
times that bound, so that an adapter or a vector left out cannot pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine_checks import ENGINE_OPTIONS, GPU

pytestmark = pytest.mark.engine

CASES = {"plain": None, "steered": "post_attn-all", "mixed-phases": "mixed-phases"}
"""Steering of each request (a ``tiny_models.STATIC_CASES`` name), sent with and without the
adapter."""


def _compare(hf: Any, outs: dict[str, Any], specs: dict[str, Any],
             plain: Any = None) -> dict[str, tuple[float, float]]:
    """Per request: (largest logprob error against ``hf`` with its steering as hooks, how far
    that reference moves from ``plain`` — the unsteered base model — on the same tokens)."""
    from engine_utils import generated_logprobs
    from hf_reference import run_reference
    from test_gating_reference import PROMPT

    found = {}
    for name, out in outs.items():
        gen, got = generated_logprobs(out)
        tokens = list(out.prompt_token_ids) + gen
        entries = specs[name]["steer"] if specs[name] else []
        want, _ = run_reference(hf, tokens, len(PROMPT), entries)
        base, _ = run_reference(plain or hf, tokens, len(PROMPT))
        found[name] = (float(np.abs(got - want[len(PROMPT) - 1:]).max()),
                       float(np.abs(want - base).max()))
    return found


def test_a_batch_mixing_adapter_and_plain_requests_steers_each_as_hf(tiny_model_dir, tmp_path):
    from engine_utils import params, start_llm, stop_llm
    from hf_reference import load_hf
    from test_gating_reference import MONITOR_SITES, PROMPT
    from test_lora_steering import RANK, make_adapter, merged
    from tiny_models import STATIC_CASES
    from vllm.lora.request import LoRARequest

    path = tiny_model_dir("llama")
    adapter = make_adapter(path, tmp_path / "adapter")
    specs = {f"{lora}/{name}": ({"steer": STATIC_CASES[case]} if case else None)
             for lora in ("adapter", "base") for name, case in CASES.items()}
    loras = [LoRARequest("tiny", 1, str(adapter)) if k.startswith("adapter") else None
             for k in specs]
    llm = start_llm(path, dynsteer={**ENGINE_OPTIONS, "monitor_sites": MONITOR_SITES},
                    enable_lora=True, max_lora_rank=RANK, max_loras=1, dtype="float16", **GPU)
    try:
        sps = [params(8, spec=s, prompt_logprobs=None) for s in specs.values()]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(specs), sps, use_tqdm=False,
                            lora_request=loras)
    finally:
        stop_llm(llm)
    outs = dict(zip(specs, outs, strict=True))
    base = load_hf(path)
    found = {
        **_compare(merged(path, adapter), {k: o for k, o in outs.items() if "adapter" in k},
                   specs, plain=base),
        **_compare(base, {k: o for k, o in outs.items() if "base" in k}, specs),
    }
    bound = max(2e-3, 2 * found["base/plain"][0])
    assert all(err <= bound for err, _ in found.values()), (bound, found)
    moved = {k: effect for k, (_, effect) in found.items() if k != "base/plain"}
    assert all(effect > 5 * bound for effect in moved.values()), (bound, found)
