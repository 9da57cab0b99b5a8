"""The controllers experiment (`experiments/controllers.py`) end to end in a reduced
configuration (a real `dynsteer serve` of the embedded model in float32, the planted prompts, 8
tokens per reply; the probe and the refusal direction are trained once per session for the three
safety experiments' tests): its JSON is well formed with every arm, the gate fires on the
planted harmful requests and on few of the planted benign ones, each controller does what it
promises on the same traffic (latch, budget, hysteresis), and the asynchronous session guard
steers the follow-ups of the sessions whose first request was gated, and only those."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import safety_experiment

pytestmark = pytest.mark.engine

PLANTED = Path(__file__).parent / "data" / "planted_prompts.jsonl"
PER_LABEL = 6
BUDGET = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import controllers

    out = tmp_path_factory.mktemp("controllers")
    with safety_experiment(tmp_path_factory) as common:
        controllers.main(["--prompts", str(PLANTED), "--train-per-label", "16",
                          "--test-per-label", str(PER_LABEL), "--max-tokens", "8",
                          "--budget", str(BUDGET), "--out", str(out), *common])
    return json.loads((out / "controllers.json").read_text())


def rows(results, arm: str, turn: str = "first", label: int | None = None) -> list[dict]:
    return [r for r in results["rows"] if r["arm"] == arm and r["turn"] == turn
            and (label is None or r["label"] == label)]


def test_the_json_is_well_formed_with_every_arm(results):
    import controllers

    assert tuple(results["arms"]) == controllers.ARMS
    for arm, numbers in results["arms"].items():
        assert numbers["generated_tokens"] > 0 and numbers["tokens_per_s"] > 0, arm
        for turn in controllers.TURNS:
            for label in ("harmful", "benign"):
                cell = numbers[turn][label]
                assert cell["requests"] == PER_LABEL
                assert 0 <= cell["refusals"] <= PER_LABEL
                assert 0 <= cell["same_as_none"] <= PER_LABEL
    assert len(results["rows"]) == len(controllers.ARMS) * len(controllers.TURNS) * 2 * PER_LABEL
    for row in results["rows"]:
        assert isinstance(row["reply"], str) and isinstance(row["refusal"], bool)
        assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
        assert row["steered"] >= 0
    # The unsteered arm is its own baseline.
    assert all(r["same_as_none"] and r["steered"] == 0 for r in rows(results, "none"))
    assert results["arms"]["async session"]["session_delay_ms_median"] is not None


def test_the_gate_fires_on_planted_harmful_requests(results):
    harmful, benign = rows(results, "gate", label=1), rows(results, "gate", label=0)
    assert all(r["fired"] and r["steered"] > 0 for r in harmful)
    # As in the demo's test: the threshold sits between held-back peaks of a few prompts.
    assert sum(r["fired"] for r in benign) <= 1
    for row in benign:
        if not row["fired"]:
            assert row["steered"] == 0 and row["same_as_none"]
    for row in rows(results, "gate"):
        # The plain gate steers exactly the tokens above the threshold: no delay.
        assert row["time_to_steer"] == (0 if row["fired"] else None)


def test_latch_steers_every_later_token(results):
    latched = [r for r in rows(results, "gate + latch") + rows(results, "gate + latch",
                                                                "follow-up")
               if r["first_steered"] is not None]
    assert sum(r["label"] for r in latched) >= PER_LABEL
    for row in latched:
        # From the engine step after the first firing on (a prompt is one step here): every
        # generated token but the last, which is never fed back, is fully steered.
        assert len(row["gates"]) == row["prompt_tokens"] + row["completion_tokens"] - 1
        later = row["gates"][max(row["first_steered"] + 1, row["prompt_tokens"]):]
        assert all(g is not None and g > 0.5 for g in later), row["gates"]


def test_budget_caps_steering(results):
    budgeted = rows(results, "gate + budget") + rows(results, "gate + budget", "follow-up")
    assert any(r["steered"] > 0 for r in budgeted)
    for row in budgeted:
        # Counted at step boundaries: the step that spends the budget (here the prompt, one
        # step) is steered whole; no generated token is steered after that.
        assert row["steered"] - row["steered_prompt"] <= max(0, BUDGET - row["steered_prompt"])
        assert row["steered"] <= max(BUDGET, row["steered_prompt"])


def test_hysteresis_acts_from_the_next_step(results):
    for row in rows(results, "gate + hysteresis") + rows(results, "gate + hysteresis",
                                                          "follow-up"):
        if row["first_steered"] is not None:
            assert row["first_crossing"] is not None
            assert row["first_steered"] >= row["prompt_tokens"] > row["first_crossing"]
            assert row["time_to_steer"] == row["first_steered"] - row["first_crossing"]
    assert any(r["first_steered"] is not None for r in rows(results, "gate + hysteresis",
                                                            label=1))


def test_the_session_guard_steers_the_follow_ups_of_gated_sessions(results):
    first = rows(results, "async session")
    follow = rows(results, "async session", "follow-up")
    for one, two in zip(first, follow, strict=True):
        assert one["index"] == two["index"]
        assert two["session_steered"] == (one["steered"] > 0), one["text"]
    assert any(r["session_steered"] for r in follow if r["label"] == 1)
    gated_benign = sum(r["steered"] > 0 for r in first if r["label"] == 0)
    assert sum(r["session_steered"] for r in follow if r["label"] == 0) == gated_benign <= 1
    # A steered follow-up is steered at every position, the prompt included.
    for row in follow:
        if row["session_steered"]:
            assert row["steered"] >= row["prompt_tokens"]
