"""Directional ablation and projection clamping (``"op": "ablate" | "clamp"``) match an HF
reference, static and gated, at every hook and phase, on two architectures (Llama, Qwen3).

One engine per architecture with two projection slots (``max_projections``): the cases put one
or two projections at a site (two non-orthogonal directions check that they apply one after
the other), mix them with adds and with global steering, and gate them with a probe whose
threshold splits the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import ALL_SITES, LOGPROB_ATOL, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf, load_hf, reference_logprobs, run_reference
from tiny_models import vec

from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 120, 33, 5]
MAX_TOKENS = 6
MONITOR_SITES = "post_block@1"


def _near(a: list[float], b: list[float], weight: float) -> list[float]:
    """A direction between ``a`` and ``b`` (not orthogonal to either)."""
    return (np.asarray(a) + weight * np.asarray(b)).tolist()


STATIC_CASES: dict[str, list[dict]] = {
    "ablate-pre_attn-all": [{"vector": vec(41), "layers": [1, 2], "hook": "pre_attn",
                             "op": "ablate"}],
    "clamp-pre_attn-prefill": [{"vector": vec(42), "layers": [0, 3], "hook": "pre_attn",
                                "phase": "prefill", "op": "clamp", "value": 6.0}],
    "clamp-post_attn-all": [{"vector": vec(43), "layers": [1], "hook": "post_attn",
                             "op": "clamp", "value": -5.0, "scale": 0.8}],
    "ablate-post_attn-decode": [{"vector": vec(44), "layers": [0, 1, 2, 3],
                                 "hook": "post_attn", "phase": "decode", "op": "ablate",
                                 "scale": 3.0}],
    "clamp-post_block-decode": [{"vector": vec(45), "layers": [2], "phase": "decode",
                                 "op": "clamp", "value": 8.0}],
    "two-slots-and-add": [
        {"vector": vec(46), "layers": [1], "op": "clamp", "value": 7.0},
        {"vector": _near(vec(46), vec(47), 1.0), "layers": [1], "op": "ablate"},
        {"vector": vec(48), "layers": [1, 3]},
    ],
}
"""Static cases: every hook and phase, scales, two slots at one site, with an add."""

GATED_CASES: dict[str, dict] = {
    "gated-clamp": {"gate": {"probe": {"weights": vec(5, norm=1.0)}, "layer": 1,
                             "steer": [{"vector": vec(51), "layers": [1, 3], "op": "clamp",
                                        "value": 8.0}]}},
    "gated-ablate-with-static": {
        "steer": [{"vector": vec(52), "layers": [1], "op": "clamp", "value": 4.0}],
        "gate": {"probe": {"weights": vec(6, norm=1.0)}, "layer": 1,
                 "steer": [{"vector": _near(vec(52), vec(53), 0.5), "layers": [1],
                            "op": "ablate"},
                           {"vector": vec(54), "layers": [2], "hook": "pre_attn",
                            "phase": "decode", "op": "clamp", "value": -6.0}]}},
}
"""Gated cases (thresholds filled from HF scores): at the monitor site and later ones, static
and gated projections at one site, a decode-only gated clamp."""

GLOBAL = [{"vector": vec(60), "layers": [3], "hook": "post_attn", "op": "ablate"}]
"""Global steering of the last group of requests: its projection comes before theirs."""


def calibrate(hf, spec: dict) -> dict:
    """Threshold between the two middle prompt scores, sharpness 4 / score spread."""
    trial = {**spec["gate"], "threshold": 0.0, "sharpness": 1.0}
    _, steerer = run_reference(hf, PROMPT, len(PROMPT), spec.get("steer", []), gate=trial)
    scores = steerer.scores.numpy()
    middle = np.sort(scores)[len(scores) // 2 - 1: len(scores) // 2 + 1]
    return {**spec, "gate": {**spec["gate"], "threshold": float(middle.mean()),
                             "sharpness": float(4.0 / (scores.std() + 1e-6))}}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def projected(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    hf = load_hf(path)
    gated = {name: calibrate(hf, spec) for name, spec in GATED_CASES.items()}
    specs = {**{n: {"steer": e} for n, e in STATIC_CASES.items()}, **gated}
    llm = start_llm(path, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES,
                                    "max_projections": 2}, in_process=True)
    try:
        names = list(specs)
        outs = dict(zip(names, run(llm, [PROMPT] * len(names),
                                   [params(MAX_TOKENS, spec=specs[n]) for n in names]),
                        strict=True))
        steering = Steering(llm)
        steering.set_global(GLOBAL)
        with_global = run(llm, [PROMPT], [params(MAX_TOKENS, spec=specs["two-slots-and-add"])])
        steering.clear_global()
    finally:
        stop_llm(llm)
    return hf, specs, outs, with_global[0]


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_projections_match_hf(projected, case):
    hf, specs, outs, _ = projected
    tokens, want, _ = assert_logprobs_match_hf(hf, outs[case], specs[case]["steer"])
    plain = reference_logprobs(hf, tokens, len(PROMPT))
    assert np.abs(want - plain).max() > 20 * LOGPROB_ATOL, "steering too weak to be checked"


@pytest.mark.parametrize("case", list(GATED_CASES))
def test_gated_projections_match_hf(projected, case):
    hf, specs, outs, _ = projected
    spec = specs[case]
    tokens, want, steerer = assert_logprobs_match_hf(hf, outs[case], spec.get("steer", []),
                                                     gate=spec["gate"])
    gates = steerer.gates.numpy()
    assert (gates > 0.9).any() and (gates < 0.1).any(), "threshold should split the tokens"
    ungated = run_reference(hf, tokens, len(PROMPT), spec.get("steer", []))[0]
    assert np.abs(want - ungated).max() > 20 * LOGPROB_ATOL, "gated steering too weak"


def test_global_and_request_projections_compose(projected):
    """A request under a global ablation gets both (the global entries take a row's first
    slots at their sites)."""
    hf, specs, _, out = projected
    assert_logprobs_match_hf(hf, out, GLOBAL + specs["two-slots-and-add"]["steer"])
