"""LoRA adapters and steering in the same requests: an engine with ``enable_lora`` serves a
request that carries an adapter *and* a steering spec (static, gated) as HF transformers with
the same adapter (``peft``, merged into the weights) and the same steering as plain hooks.

The adapter is a rank-8 LoRA on every projection of the tiny Llama with random ``B`` matrices
(peft initializes them to zero, an adapter that changes nothing). Every request of a batch
carries the adapter: vLLM 0.32's CPU LoRA path applies a batch's adapter to the batch's
requests without one (seen with the plugin off too), and its LoRA logits layer fails on prompt
logprobs, so the engine's generated-token logprobs are compared. Mixed batches need the GPU
build and are not checked here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import ALL_SITES, LOGPROB_ATOL, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf, load_hf, reference_logprobs
from test_gating_reference import MONITOR_SITES, PROMPT, calibrate
from tiny_models import STATIC_CASES

pytestmark = pytest.mark.engine

RANK = 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out_dir):
    """A peft LoRA adapter for the model at ``model_dir`` with random ``A`` and ``B``."""
    from peft import LoraConfig, get_peft_model

    hf = load_hf(model_dir)
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=16, target_modules=PROJECTIONS,
                                               lora_dropout=0.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged(model_dir, adapter_dir):
    """HF transformers with the adapter merged into its weights (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(model_dir), adapter_dir).merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """(merged HF, specs, the adapter requests' outputs by case, a request without the adapter
    in a batch of its own) of one ``enable_lora`` engine."""
    from tiny_models import vec
    from vllm.lora.request import LoRARequest

    path = tiny_model_dir("llama")
    adapter = make_adapter(path, tmp_path_factory.mktemp("adapter"))
    hf = merged(path, adapter)
    gated = calibrate(hf, {"gate": {"probe": {"weights": vec(1, norm=1.0)}, "layer": 1,
                                    "steer": [{"vector": vec(31), "layers": [1, 3]}]}})
    specs = {"adapter": None, **{n: {"steer": STATIC_CASES[n]}
                                 for n in ("post_attn-all", "mixed-phases")}, "gated": gated}
    prompts = [PROMPT] * len(specs)
    llm = start_llm(path, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES},
                    enable_lora=True, max_lora_rank=RANK, max_loras=1, in_process=True)
    try:
        request = LoRARequest("tiny", 1, str(adapter))
        sps = [params(6, spec=s, prompt_logprobs=None) for s in specs.values()]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False,
                            lora_request=[request] * len(specs))
        outs = dict(zip(specs, outs, strict=True))
        plain = run(llm, [PROMPT], [params(6, prompt_logprobs=None)])[0]
    finally:
        stop_llm(llm)
    return hf, specs, outs, plain


def test_the_adapter_alone_matches_hf_with_the_adapter_merged(lora_run, tiny_model_dir):
    """The adapter request equals HF with the adapter; the request without it (alone in its
    batch) equals HF without it; and the adapter moves the logprobs enough to tell."""
    hf, _, outs, plain = lora_run
    tokens, want, _ = assert_logprobs_match_hf(hf, outs["adapter"])
    base = load_hf(tiny_model_dir("llama"))
    assert_logprobs_match_hf(base, plain)
    without = reference_logprobs(base, tokens, len(PROMPT))
    assert np.abs(want - without).max() > 20 * LOGPROB_ATOL, "the adapter changes nothing"


@pytest.mark.parametrize("case", ["post_attn-all", "mixed-phases"])
def test_adapter_and_static_steering_match_hf(lora_run, case):
    """Static steering (``post_attn`` at two layers; three hooks in two phases) on top of the
    adapter equals HF's hooks on the merged model, and moves the logprobs enough to tell."""
    hf, specs, outs, _ = lora_run
    tokens, want, _ = assert_logprobs_match_hf(hf, outs[case], specs[case]["steer"])
    unsteered = reference_logprobs(hf, tokens, len(PROMPT))
    assert np.abs(want - unsteered).max() > 20 * LOGPROB_ATOL, "steering too weak to be checked"


def test_adapter_and_gated_steering_match_hf(lora_run):
    """A probe-gated vector on top of the adapter: HF's gates on the merged model."""
    from test_gating_reference import assert_gated_matches_hf

    hf, specs, outs, _ = lora_run
    assert_gated_matches_hf(hf, specs["gated"], outs["gated"])
