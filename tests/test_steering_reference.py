"""Per-request static steering matches an HF transformers reference, for each architecture.

One real engine per architecture (compile on, fp32, CPU build), all three hooks at every layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import logprobs_of, params, run, start_llm, stop_llm
from hf_reference import load_hf, reference_logprobs
from tiny_models import HIDDEN

pytestmark = pytest.mark.engine

TOL = 2e-3
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 300, 5, 77, 8]]


def vec(seed: int, norm: float = 4.0) -> list[float]:
    v = np.random.RandomState(seed).randn(HIDDEN)
    return (v / np.linalg.norm(v) * norm).tolist()


CASES = {
    "pre_attn-all": [{"vector": vec(1), "layers": [0, 2], "hook": "pre_attn"}],
    "pre_attn-prefill": [{"vector": vec(2), "layers": [1, 3], "hook": "pre_attn",
                          "phase": "prefill"}],
    "post_attn-all": [{"vector": vec(3), "layers": [1, 2], "hook": "post_attn", "scale": 1.5}],
    "post_attn-decode": [{"vector": vec(4), "layers": [0, 3], "hook": "post_attn",
                          "phase": "decode"}],
    "post_block-all": [{"vector": vec(5), "layers": [0, 1, 3], "hook": "post_block"}],
    "post_block-decode": [{"vector": vec(6), "layers": [2], "phase": "decode", "scale": -2.0}],
    "mixed-phases": [
        {"vector": vec(7), "layers": [1], "hook": "pre_attn", "phase": "prefill"},
        {"vector": vec(8), "layers": [1, 2], "hook": "post_attn", "phase": "decode"},
        {"vector": vec(9), "layers": [3], "hook": "post_block"},
    ],
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_outputs(request, tiny_model_dir):
    """Run baseline + every case on one engine in one batch; stop the engine."""
    path = tiny_model_dir(request.param)
    llm = start_llm(path, dynsteer={"sites": "pre_attn@*,post_attn@*,post_block@*"})
    try:
        names = ["baseline", *CASES]
        prompts = [PROMPTS[i % 2] for i in range(len(names))]
        sps = [params(spec=None if n == "baseline" else {"steer": CASES[n]}) for n in names]
        outs = dict(zip(names, run(llm, prompts, sps), strict=True))
    finally:
        stop_llm(llm)
    return request.param, load_hf(path), outs, dict(zip(names, prompts, strict=True))


def test_baseline_matches_hf(arch_outputs):
    """With the plugin on and no steering, logprobs equal HF's."""
    _, hf, outs, prompts = arch_outputs
    tokens, got = logprobs_of(outs["baseline"])
    want = reference_logprobs(hf, tokens, len(prompts["baseline"]))
    np.testing.assert_allclose(got, want, atol=TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_steered_logprobs_match_hf(arch_outputs, case):
    """Prompt and generated-token logprobs under steering equal the HF hook reference."""
    _, hf, outs, prompts = arch_outputs
    tokens, got = logprobs_of(outs[case])
    prompt_len = len(prompts[case])
    want = reference_logprobs(hf, tokens, prompt_len, CASES[case])
    np.testing.assert_allclose(got, want, atol=TOL)
    unsteered = reference_logprobs(hf, tokens, prompt_len)
    assert np.abs(want - unsteered).max() > 20 * TOL, "steering too weak to be checked"
