"""Controllers in a real engine (CPU build): every built-in and third-party Python controllers
against a step-by-step reference of their decisions, and the HF reference with those decisions.

The prompt runs as one step (prefill), every generated token as one more. A built-in's
decisions after step ``i`` apply from step ``i + 1``; a Python controller's from ``i + 2``
(``PYTHON_LAG``). The probe reads ``post_block@1`` before any gated site, so its scores do not
depend on the decisions and the reference can replay them from the HF scores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from engine_utils import (
    LOGPROB_ATOL,
    assert_same_output,
    logprobs_of,
    params,
    run,
    start_llm,
    stop_llm,
)
from hf_reference import assert_logprobs_match_hf, load_hf, run_reference
from test_controllers import reference_fold
from tiny_models import vec

from dynsteer.controller.controllers import BUILTINS, PYTHON_LAG
from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64, 120, 33, 5]
MAX_TOKENS = 12
OPTIONS = {"sites": "post_block@*", "monitor_sites": "post_block@1"}
ALT = vec(40)


def base_gate(hf) -> dict:
    """The gate every case shares: threshold between the two middle prompt scores (HF)."""
    gate = {"probe": {"weights": vec(1, norm=1.0)}, "layer": 1, "trace": True,
            "steer": [{"vector": vec(31), "layers": [1, 3]}]}
    _, steerer = run_reference(hf, PROMPT, len(PROMPT), gate={**gate, "threshold": 0.0})
    scores = steerer.scores.numpy()
    middle = np.sort(scores)[len(scores) // 2 - 1: len(scores) // 2 + 1]
    return {**gate, "threshold": float(middle.mean()),
            "sharpness": float(4.0 / (scores.std() + 1e-6))}, scores


def cases(scores: np.ndarray, gate: dict) -> dict[str, dict | None]:
    """Controller specs whose decisions change mid-generation (from the prompt's scores):
    ``hysteresis`` switches on at the first generated token (the prompt's last token is above
    ``t_on``)."""
    on = int((scores > gate["threshold"]).sum())  # prompt tokens with gate > 0.5
    q25, q75 = (float(np.quantile(scores, q)) for q in (0.25, 0.75))
    spread = float(scores.max() - scores.min())
    t_on = float(scores[-1]) - 0.05 * spread
    return {
        "gate-only": None,
        "latch": {"name": "latch", "k": on + 1},
        "latch-threshold": {"name": "latch", "k": int((scores > q75).sum()) + 1,
                            "threshold": q75},
        "hysteresis": {"name": "hysteresis", "t_on": t_on, "t_off": min(q25, t_on - 0.1 * spread)},
        "proportional": {"name": "proportional", "threshold": float(scores.min()),
                         "gain": 1.0 / spread, "max": spread},
        "budget": {"name": "budget", "tokens": on + 2},
        "pylatch": {"name": "pylatch", "k": on + 1},
        "half": {"name": "half"},
        "raiser": {"name": "raiser"},
    }


def steps(prompt_len: int, n: int) -> list[list[int]]:
    return [list(range(prompt_len))] + [[p] for p in range(prompt_len, n)]


def builtin_gates(spec: dict, scores: np.ndarray, gates: np.ndarray,
                  prompt_len: int) -> np.ndarray:
    """A built-in's gates, step by step (decisions apply from the next step)."""
    cls = BUILTINS[spec["name"]]
    p = cls.Params.model_validate({k: v for k, v in spec.items() if k != "name"})
    row = [float(cls.kind), *cls.initial_state(p), 0.0, *cls.device_params(p), 0.0]
    out = gates.copy()
    for step in steps(prompt_len, len(scores)):
        for t in step:
            out[t] = max(gates[t], row[1]) * row[2]
        row = reference_fold(row, [out[t] for t in step], [scores[t] for t in step])
    return out


def python_gates(spec: dict, scores: np.ndarray, gates: np.ndarray,
                 prompt_len: int) -> np.ndarray:
    """The test plugins' controllers (see ``plugins/dynsteer_test_controllers.py``), step by
    step; actions from step ``i`` apply from step ``i + PYTHON_LAG``."""
    out = gates.copy()
    floor, scale, count = 0.0, 1.0, 0
    decided: dict[int, tuple[float, float]] = {}
    for i, step in enumerate(steps(prompt_len, len(scores))):
        floor, scale = decided.get(i, (floor, scale))
        for t in step:
            out[t] = max(gates[t], floor) * scale
        count += sum(out[t] > 0.5 for t in step)
        if spec["name"] == "pylatch" and count >= spec["k"]:
            decided[i + PYTHON_LAG] = (1.0, decided.get(i + PYTHON_LAG - 1, (floor, scale))[1])
        elif spec["name"] == "half":
            decided[i + PYTHON_LAG] = (floor, 0.5)
    return out


def decisions(spec: dict | None, prompt_len: int):
    """``gate_fn`` of the HF reference for a case."""
    if spec is None or spec["name"] == "raiser":
        return None
    replay = builtin_gates if spec["name"] in BUILTINS else python_gates
    return lambda scores, gates: replay(spec, scores, gates, prompt_len)


@pytest.fixture(scope="module")
def controlled_run(tiny_model_dir, controller_plugins):
    path = tiny_model_dir("llama")
    hf = load_hf(path)
    gate, scores = base_gate(hf)
    specs = cases(scores, gate)
    llm = start_llm(path, dynsteer=OPTIONS, in_process=True)
    try:
        steering = Steering(llm)
        steering.register_vector("alt", ALT)
        steering.set_session("conv-1", steer=[{"vector": "alt", "layers": [2]}])
        names = [*specs, "switcher", "plain", "session", "explicit"]
        sps = [params(MAX_TOKENS, spec={"gate": gate, "controller": specs[n]}
                      if specs[n] else {"gate": gate}) for n in specs]
        sps.append(params(MAX_TOKENS, spec={"gate": gate, "controller": {
            "name": "switcher", "vector": "alt"}}))
        sps.append(params(MAX_TOKENS))
        sps.append(params(MAX_TOKENS, spec={"session": "conv-1"}))
        sps.append(params(MAX_TOKENS, spec={"steer": [{"vector": "alt", "layers": [2]}]}))
        outs = dict(zip(names, run(llm, [PROMPT] * len(names), sps), strict=True))
        telemetry = {n: steering.telemetry(o) for n, o in outs.items()}
        outs["latch+idle"] = with_idle_batches(llm, params(MAX_TOKENS, spec={
            "gate": gate, "controller": specs["latch"]}))
        info = steering.info()
    finally:
        stop_llm(llm)
    return hf, gate, specs, outs, telemetry, info


def with_idle_batches(llm, sp):
    """One request run step by step with an idle batch (what a data-parallel rank without
    requests runs, vLLM's ``execute_dummy_batch``) before every step."""
    engine = llm.llm_engine
    engine.add_request("idle-batches", {"prompt_token_ids": PROMPT}, sp)
    finished = []
    while engine.has_unfinished_requests():
        engine.engine_core.execute_dummy_batch()
        finished += [o for o in engine.step() if o.finished]
    (out,) = finished
    return out


CASES = ["latch", "latch-threshold", "hysteresis", "proportional", "budget", "pylatch", "half"]


@pytest.mark.parametrize("case", CASES)
def test_controller_decisions_match_the_reference(controlled_run, case):
    """The gates the engine steered with (trace) are the step-by-step reference's, the
    decisions change mid-generation, and the logprobs equal HF steered with those gates."""
    hf, gate, specs, outs, telemetry, _ = controlled_run
    spec = specs[case]
    tokens, want, steerer = assert_logprobs_match_hf(
        hf, outs[case], [], gate=gate, gate_fn=decisions(spec, len(PROMPT)))
    processed = len(tokens) - 1
    expected = steerer.gates.numpy()[:processed]
    report = telemetry[case]
    np.testing.assert_allclose(np.array(report["gates"][:processed], dtype=float), expected,
                               atol=2e-3)
    raw = run_reference(hf, tokens, len(PROMPT), gate=gate)[1].gates.numpy()[:processed]
    changed = np.flatnonzero(np.abs(expected - raw) > 0.05)
    assert len(changed), "the controller never changed a gate"
    if case in ("hysteresis", "proportional"):  # off until a step's scores say otherwise
        assert (expected[:len(PROMPT)] == 0).all()
    else:  # the plain gate until a decision
        assert changed.min() >= len(PROMPT), "a decision applied during the prompt step"
    assert report["controller"]["name"] == spec["name"]
    assert report["controller"]["error"] is None
    events = report["controller"]["events"]
    assert events and events[0]["position"] >= len(PROMPT)
    plain = run_reference(hf, tokens, len(PROMPT), gate=gate)[0]
    assert np.abs(want - plain).max() > 10 * LOGPROB_ATOL, "decisions too weak to be checked"


def test_idle_batches_between_steps_change_nothing(controlled_run):
    """Forwards no request is in (a data-parallel rank's idle batches) between the steps of
    a latched request: its output and logprobs are those of the run without them (the index
    is cleared before them, after the last step was folded into the controller)."""
    _, _, _, outs, _, _ = controlled_run
    assert_same_output(outs["latch+idle"], outs["latch"])


def test_latch_fires_at_the_step_after_the_kth_token(controlled_run):
    """Hand-checked: the latch event is at the first position after the step where the k-th
    token above threshold was seen, and every later gate is 1."""
    _, _, specs, _, telemetry, _ = controlled_run
    report = telemetry["latch"]
    gates = np.array(report["gates"], dtype=float)
    above = np.cumsum(gates > 0.5)
    kth = int(np.argmax(above >= specs["latch"]["k"]))
    (event,) = report["controller"]["events"]
    assert event == {"position": kth + 1, "floor": 1.0, "scale": 1.0}
    assert (gates[kth + 1:] == 1.0).all() and not (gates[len(PROMPT):kth + 1] == 1.0).all()


def test_budget_stops_after_its_tokens(controlled_run):
    _, _, specs, _, telemetry, _ = controlled_run
    gates = np.array(telemetry["budget"]["gates"], dtype=float)
    steered = gates > 0.5
    assert steered.sum() == specs["budget"]["tokens"]
    assert not steered[int(np.flatnonzero(steered)[-1]) + 1:].any()


def test_a_raising_controller_is_contained(controlled_run):
    """The request runs with its plain gate (same logprobs as no controller), its report
    names the error, the engine kept serving the rest of the batch."""
    _, _, _, outs, telemetry, info = controlled_run
    got, want = logprobs_of(outs["raiser"]), logprobs_of(outs["gate-only"])
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    assert telemetry["raiser"]["controller"]["error"] == "RuntimeError: controller bug"
    assert info[0]["controllers"]["raiser"]["errors"] == 1
    assert len(outs["plain"].outputs[0].token_ids) == MAX_TOKENS


def test_switch_vector_takes_effect_and_is_reported(controlled_run):
    hf, gate, _, outs, telemetry, _ = controlled_run
    report = telemetry["switcher"]["controller"]
    at = len(PROMPT) + PYTHON_LAG - 1  # actions of the prefill step apply from step 2
    assert {"position": at, "action": "switch_vector", "name": "alt"} in [
        {k: e[k] for k in ("position", "action", "name") if k in e} for e in report["events"]]
    assert {"position": at, "floor": 1.0, "scale": 1.0} in report["events"]
    tokens, _ = logprobs_of(outs["switcher"])
    # HF: vec(31) gated before the switch, ALT at gate 1 from it on.
    before = run_reference(hf, tokens, len(PROMPT), gate=gate)[0]
    _, got = logprobs_of(outs["switcher"])
    np.testing.assert_allclose(got[:at], before[:at], atol=LOGPROB_ATOL)
    assert not np.allclose(got[at:], before[at:], atol=10 * LOGPROB_ATOL)


def test_controller_metrics_and_checksum(controlled_run):
    *_, info = controlled_run
    rank = info[0]
    assert rank["controller_checked_steps"] >= MAX_TOKENS - 1
    assert int(rank["controller_checksum"], 16) != 0
    for name in ("pylatch", "half", "budget", "hysteresis"):
        assert rank["controllers"][name]["requests"] == 1
    assert rank["controllers"]["latch"]["requests"] == 3  # latch, latch-threshold, +idle
    assert rank["controllers"]["pylatch"]["calls"] >= MAX_TOKENS - PYTHON_LAG
    assert math.isfinite(rank["controllers"]["pylatch"]["seconds"])


def test_offline_session_steering_reaches_the_sessions_requests(controlled_run):
    """``Steering.set_session``: a request naming the session is steered as if it carried the
    session's entries itself."""
    *_, outs, _, _ = controlled_run
    got, want = logprobs_of(outs["session"]), logprobs_of(outs["explicit"])
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    plain = logprobs_of(outs["plain"])[1]
    assert np.abs(got[1][: len(plain)] - plain).max() > 10 * LOGPROB_ATOL
