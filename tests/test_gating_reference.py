"""Probe-gated dynamic steering matches an HF reference (Llama and Qwen3), with telemetry.

Thresholds are set from the HF scores of the prompt (the median), so some tokens are gated and
others are not; sharpness makes gates clearly on or off for most tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import ALL_SITES, LOGPROB_ATOL, logprobs_of, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf, load_hf, run_reference
from tiny_models import vec

from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 120, 33, 5]
MAX_TOKENS = 8


def base_cases() -> dict[str, dict]:
    """Gates without thresholds yet (filled from HF scores). All but ``registered-decode`` ask
    for the per-position gate trace; the counters come without it."""
    return {
        "same-site": {"gate": {"probe": {"weights": vec(1, norm=1.0)}, "layer": 1, "trace": True,
                               "steer": [{"vector": vec(31), "layers": [1]}]}},
        "cross-layer": {"gate": {"probe": {"weights": vec(2, norm=1.0)}, "layer": 1,
                                 "trace": True,
                                 "steer": [{"vector": vec(32), "layers": [1, 3]}]}},
        "registered-decode": {"gate": {"probe": "toxicity", "layer": 2, "hook": "pre_attn",
                                       "steer": [{"vector": vec(33), "layers": [2],
                                                  "hook": "post_attn", "phase": "decode"},
                                                 {"vector": vec(34), "layers": [3],
                                                  "phase": "decode"}]}},
        "prefill-with-static": {
            "steer": [{"vector": vec(35), "layers": [0], "scale": 0.5}],
            "gate": {"probe": {"weights": vec(4, norm=1.0)}, "layer": 0, "hook": "post_attn",
                     "trace": True,
                     "steer": [{"vector": vec(36), "layers": [1], "hook": "pre_attn",
                                "phase": "prefill"}]}},
    }


MONITOR_SITES = "post_attn@0,post_block@1,pre_attn@2"
"""Where the cases' probes read; gated steering elsewhere (post_block@3, post_attn@2,
pre_attn@1) goes through the fused add reading the gate the monitor wrote."""
REGISTERED = {"toxicity": {"weights": vec(3, norm=1.0), "threshold": 0.0, "sharpness": 1.0}}


def register_probes(steering) -> None:
    """Register :data:`REGISTERED` (what the ``registered-decode`` case gates with)."""
    for name, p in REGISTERED.items():
        steering.register_probe(name, weights=p["weights"], threshold=p["threshold"],
                                sharpness=p["sharpness"])


def spread(scores: np.ndarray) -> float:
    """The scores' standard deviation, or their median absolute deviation (scaled to it:
    1.4826) where a few outliers make that less than half the standard deviation."""
    std = float(scores.std())
    mad = 1.4826 * float(np.median(np.abs(scores - np.median(scores))))
    return mad if 0 < mad < std / 2 else std


def calibrate(hf, spec: dict) -> dict:
    """Threshold midway between the two middle prompt scores, sharpness 4 / score spread (the
    standard deviation, or the scaled median absolute deviation where a few outlying scores
    inflate it: GPT-NeoX's first token).

    Scores come from HF with the spec's static steering, so the gate splits the prompt."""
    trial = {**spec["gate"], "threshold": 0.0, "sharpness": 1.0}
    _, steerer = run_reference(hf, PROMPT, len(PROMPT), spec.get("steer", []), gate=trial,
                               probes=REGISTERED)
    scores = steerer.scores.numpy()
    middle = np.sort(scores)[len(scores) // 2 - 1: len(scores) // 2 + 1]
    gate = {**spec["gate"], "threshold": float(middle.mean()),  # between two scores
            "sharpness": float(4.0 / (spread(scores) + 1e-6))}
    return {**spec, "gate": gate}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def gated_run(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    hf = load_hf(path)
    cases = {name: calibrate(hf, spec) for name, spec in base_cases().items()}
    # The monitor sites are the gates'; every other site steers by the fused tensor ops.
    llm = start_llm(path, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES},
                    in_process=True)
    try:
        steering = Steering(llm)
        register_probes(steering)
        names = ["plain", *cases]
        outs = run(llm, [PROMPT] * len(names),
                   [params(MAX_TOKENS, spec=cases.get(n)) for n in names])
        telemetry = {n: steering.telemetry(o) for n, o in zip(names, outs, strict=True)}
    finally:
        stop_llm(llm)
    return hf, cases, dict(zip(names, outs, strict=True)), telemetry


def assert_gated_matches_hf(hf, spec: dict, out,
                            strength: float = 20) -> tuple[list[int], np.ndarray]:
    """``out`` (a calibrated case's request) equals the HF hook reference, whose gate splits
    the tokens and whose gated steering moves some logprob by ``strength`` tolerances (enough
    to be checked); returns (all tokens, HF's gate per position)."""
    tokens, want, steerer = assert_logprobs_match_hf(hf, out, spec.get("steer", []),
                                                     gate=spec["gate"], probes=REGISTERED)
    gates = steerer.gates.numpy()
    assert (gates > 0.9).any() and (gates < 0.1).any(), "threshold should split the tokens"
    plain = run_reference(hf, tokens, len(PROMPT), spec.get("steer", []))[0]
    assert np.abs(want - plain).max() > strength * LOGPROB_ATOL, \
        "gated steering too weak to be checked"
    return tokens, gates


@pytest.mark.parametrize("case", list(base_cases()))
def test_gated_logprobs_match_hf(gated_run, case):
    """Prompt + decode logprobs under gated steering equal the HF hook reference."""
    hf, cases, outs, _ = gated_run
    assert_gated_matches_hf(hf, cases[case], outs[case])


@pytest.mark.parametrize("case", list(base_cases()))
def test_telemetry_matches_hf(gated_run, case):
    """Telemetry (gated token counts, first decode position, max score) equals HF's."""
    hf, cases, outs, telemetry = gated_run
    spec = cases[case]
    tokens, _ = logprobs_of(outs[case])
    _, steerer = run_reference(hf, tokens, len(PROMPT), spec.get("steer", []),
                               gate=spec["gate"], probes=REGISTERED)
    processed = len(tokens) - 1  # the last generated token is never fed back
    want_gates = steerer.gates.numpy()[:processed]
    report = telemetry[case]
    assert report["tokens_monitored"] == processed
    if spec["gate"].get("trace"):
        got_gates = np.array(report["gates"][:processed], dtype=np.float64)
        np.testing.assert_allclose(got_gates, want_gates, atol=2e-3)
    else:
        assert report["gates"] is None
    on = want_gates > 0.5
    pos = np.arange(processed)
    assert report["gated_prefill"] == int((on & (pos < len(PROMPT))).sum())
    assert report["gated_decode"] == int((on & (pos >= len(PROMPT))).sum())
    decode_on = np.flatnonzero(on & (pos >= len(PROMPT)))
    want_first = int(decode_on[0] - len(PROMPT)) if len(decode_on) else None
    assert report["first_decode_gated"] == want_first
    assert report["first_gated"] == (int(np.flatnonzero(on)[0]) if on.any() else None)
    assert report["max_score"] == pytest.approx(steerer.scores.numpy()[:processed].max(),
                                                abs=2e-3)


def test_plain_request_has_no_telemetry(gated_run):
    _, _, _, telemetry = gated_run
    assert telemetry["plain"] is None
