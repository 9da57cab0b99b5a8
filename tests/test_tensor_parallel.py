"""Steering runs on every TP rank: TP=2 logprobs equal TP=1 (CPU build, one core per rank),
and controllers (built-in and Python) apply the same actions on both ranks."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_utils import (
    ALL_SITES,
    LOGPROB_ATOL,
    assert_same_output,
    logprobs_of,
    params,
    run,
    start_llm,
    stop_llm,
)
from tiny_models import STATIC_CASES, vec

from dynsteer.engine_ext import Steering

pytestmark = [pytest.mark.engine, pytest.mark.tp2]

GATE = {"probe": {"weights": vec(1, norm=1.0), "threshold": 0.0, "sharpness": 50.0},
        "layer": 1, "steer": [{"vector": vec(31), "layers": [1, 3]}]}
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 17, 42, 99, 7, 250, 3, 64], [1, 9, 8, 7],
           [1, 17, 42, 99, 7, 250, 3, 64], [1, 5, 6, 7, 8], [1, 17, 42, 99, 7, 250, 3, 64]]
SPECS = [
    None,
    {"steer": STATIC_CASES["mixed-phases"]},
    {"steer": STATIC_CASES["post_attn-all"] + STATIC_CASES["post_block-decode"]},
    {"gate": GATE, "controller": {"name": "latch", "k": 2}},
    {"gate": GATE, "controller": {"name": "proportional", "gain": 3.0}},
    {"gate": GATE, "controller": {"name": "pylatch", "k": 3}, "session": "s1"},
]


def _outputs(path, tp: int):
    llm = start_llm(path, dynsteer={"sites": ALL_SITES}, tensor_parallel_size=tp)
    try:
        outs = run(llm, PROMPTS, [params(spec=s) for s in SPECS])
        return outs, Steering(llm).info()
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def tp_outputs(tiny_model_dir, controller_plugins):
    path = tiny_model_dir("llama")
    single = _outputs(path, 1)
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank on a 2-core machine
    try:
        double = _outputs(path, 2)
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    return single, double


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_tp2_equals_tp1(tp_outputs, i):
    """Steered (and unsteered) logprobs under TP=2 equal the TP=1 result."""
    (single, _), (double, _) = tp_outputs
    assert_same_output(double[i], single[i], atol=LOGPROB_ATOL)


def test_tp2_steering_changes_output(tp_outputs):
    """The steered TP=2 request differs from the unsteered one of the same prompt."""
    _, (double, _) = tp_outputs
    base = logprobs_of(double[0])[1][:3]
    steered = logprobs_of(double[1])[1][:3]
    assert np.abs(base - steered).max() > 1e-2


def test_tp2_controller_checksums_agree(tp_outputs):
    """Both ranks folded the same steps and applied the same controller actions (built-in
    and Python). (TP=1 folds the same steps; its scores differ from TP=2's in the last bits,
    so its checksum of the proportional controller's scales does too.)"""
    (_, single), (_, double) = tp_outputs
    assert len(double) == 2
    sums = {rank["controller_checksum"] for rank in double}
    assert len(sums) == 1 and double[0]["controller_checked_steps"] > 0
    assert double[0]["controller_checked_steps"] == double[1]["controller_checked_steps"]
    for rank in double:
        assert rank["controllers"]["pylatch"]["calls"] > 0
        assert rank["controllers"]["pylatch"]["errors"] == 0
    assert single[0]["controller_checked_steps"] == double[0]["controller_checked_steps"]
