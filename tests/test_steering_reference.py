"""Per-request static steering matches an HF transformers reference, for each architecture.

One real engine per architecture (compile on, fp32, CPU build), all three hooks at every layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import ALL_SITES, LOGPROB_ATOL, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf, load_hf, reference_logprobs
from tiny_models import STATIC_CASES

pytestmark = pytest.mark.engine

PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 300, 5, 77, 8]]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_outputs(request, tiny_model_dir):
    """Run baseline + every case on one engine in one batch; stop the engine."""
    path = tiny_model_dir(request.param)
    llm = start_llm(path, dynsteer={"sites": ALL_SITES}, in_process=True)
    try:
        names = ["baseline", *STATIC_CASES]
        prompts = [PROMPTS[i % 2] for i in range(len(names))]
        sps = [params(spec=None if n == "baseline" else {"steer": STATIC_CASES[n]})
               for n in names]
        outs = dict(zip(names, run(llm, prompts, sps), strict=True))
    finally:
        stop_llm(llm)
    return load_hf(path), outs


def test_baseline_matches_hf(arch_outputs):
    """With the plugin on and no steering, logprobs equal HF's."""
    hf, outs = arch_outputs
    assert_logprobs_match_hf(hf, outs["baseline"])


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_steered_logprobs_match_hf(arch_outputs, case):
    """Prompt and generated-token logprobs under steering equal the HF hook reference."""
    hf, outs = arch_outputs
    out = outs[case]
    tokens, want, _ = assert_logprobs_match_hf(hf, out, STATIC_CASES[case])
    unsteered = reference_logprobs(hf, tokens, len(out.prompt_token_ids))
    assert np.abs(want - unsteered).max() > 20 * LOGPROB_ATOL, "steering too weak to be checked"
