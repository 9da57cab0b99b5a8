"""The ablate / clamp cases of ``test_projection_reference.py`` (static at every hook and phase,
gated, two slots at one site, with an add) on an engine with two projection slots per row,
under CUDA graphs, against HF; each case must also have a visible effect. An engine of its own,
started after ``test_gpu_engine.py``'s has stopped."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine


def test_projections_match_hf_under_graphs(tiny_model_dir, hf_llama) -> None:
    from engine_utils import logprobs_of, params, run, start_llm, stop_llm
    from hf_reference import run_reference
    from test_projection_reference import (
        GATED_CASES,
        MAX_TOKENS,
        MONITOR_SITES,
        PROMPT,
        STATIC_CASES,
        calibrate,
    )

    specs = {**{n: {"steer": e} for n, e in STATIC_CASES.items()},
             **{n: calibrate(hf_llama, s) for n, s in GATED_CASES.items()}}
    llm = start_llm(tiny_model_dir("llama"),
                    dynsteer={"sites": "pre_attn@*,post_attn@*,post_block@*",
                              "monitor_sites": MONITOR_SITES, "max_projections": 2},
                    gpu_memory_utilization=0.3)
    try:
        outs = run(llm, [PROMPT] * len(specs),
                   [params(MAX_TOKENS, spec=s) for s in specs.values()])
    finally:
        stop_llm(llm)
    failed = {}
    for (name, spec), out in zip(specs.items(), outs, strict=True):
        tokens, got = logprobs_of(out)
        want = run_reference(hf_llama, tokens, len(PROMPT), spec.get("steer", []),
                             gate=spec.get("gate"))[0]
        plain = run_reference(hf_llama, tokens, len(PROMPT))[0]
        err, effect = float(np.abs(got - want).max()), float(np.abs(want - plain).max())
        if not (err <= 2e-3 and effect > 4e-2):
            failed[name] = {"max_abs_err_vs_hf": err, "steering_effect": effect}
    assert not failed, failed
