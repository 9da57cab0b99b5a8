"""`experiments/safety_steering.py` in a reduced configuration (a real `dynsteer serve` of the
embedded model in float32, the planted prompts, the reply probe read after 8 training requests
per label, one tiny sweep; the probe and the refusal direction are trained once per session for
the three safety experiments' tests): its JSON and plot are well formed, the gate fires on the
planted harmful requests and on few of the planted benign ones, benign requests it does not fire
on are answered and scored exactly as unsteered (adding the refusal direction or clamping the
stream's projection on it), and the teacher-forced perplexities are finite with the unsteered
arm as their baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from server_utils import safety_experiment

pytestmark = pytest.mark.engine

PLANTED = Path(__file__).parent / "data" / "planted_prompts.jsonl"
ARMS = ["none", "always on", "gated", "gated + latch", "always ablate", "always clamp",
        "gated clamp + latch"]
GATED = ["gated", "gated + latch", "gated clamp + latch"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import safety_steering

    out = tmp_path_factory.mktemp("steering")
    with safety_experiment(tmp_path_factory) as common:
        safety_steering.main(["--prompts", str(PLANTED), "--train-per-label", "16",
                              "--test-per-label", "6", "--max-tokens", "8", "--out", str(out),
                              *common,
                              "--reply-prompts", "8", "--sweeps", "threshold",
                              "--sweep-per-label", "3", "--threshold-offsets=-40,0"])
    results = json.loads((out / "safety_steering.json").read_text())
    return out, results, {arm["name"]: arm for arm in results["arms"]}


def steer_ops(arm: dict) -> list[str]:
    """The ``op`` of each of a steered arm's entries, static or gated."""
    spec = arm["spec"]
    return [e.get("op", "add") for e in spec.get("steer") or spec["gate"]["steer"]]


def test_outputs_are_well_formed(run):
    out, results, arms = run
    assert list(arms) == ARMS
    assert results["test"] == 12 and results["sweep_test"] == 6
    assert sorted(results["clamp_targets"]) == ["15", "16", "17"]
    assert all(math.isfinite(t) for t in results["clamp_targets"].values())
    assert steer_ops(arms["always on"]) == steer_ops(arms["gated + latch"]) == ["add"] * 3
    assert steer_ops(arms["always ablate"]) == ["ablate"] * 3
    assert steer_ops(arms["always clamp"]) == steer_ops(arms["gated clamp + latch"]) == [
        "clamp"] * 3
    for arm in arms.values():
        assert len(arm["rows"]) == 12
        for row in arm["rows"]:
            assert isinstance(row["reply"], str) and isinstance(row["refusal"], bool)
            assert isinstance(row["refusal_probe"], bool)
            assert row["tf_tokens"] > 0 and 0 <= row["tf_top1"] <= row["tf_tokens"]
        for label in ("harmful", "benign"):
            summary = arm["summary"][label]
            assert summary["n"] == 6 and summary["refusals"][1] == 6
            assert summary["refusals_probe"][1] == 6
            assert (summary["fired"] is None) == (arm["kind"] != "gated")
    points = results["sweeps"]["threshold"]
    assert [p["value"] for p in points] == [results["threshold"] - 40, results["threshold"]]
    assert all(p["summary"]["harmful"]["n"] == 3 for p in points)
    assert points[1]["reused"] == "gated + latch"  # the arm's own spec: its replies reused
    assert (out / "safety_steering_threshold.png").stat().st_size > 0


def test_the_gate_fires_on_planted_harmful_requests_only(run):
    _, _, arms = run
    unsteered = arms["none"]["rows"]
    for name in GATED:
        rows = arms[name]["rows"]
        assert all(r["fired"] and r["steered"] > 0 for r in rows if r["label"] == 1)
        assert sum(r["fired"] for r in rows if r["label"] == 0) <= 1
        for row, reference in zip(rows, unsteered, strict=True):
            if row["label"] == 0 and not row["fired"]:
                assert row["steered"] == 0 and row["same_as_unsteered"]
                assert row["reply"] == reference["reply"]
                assert row["tf_logprob"] == pytest.approx(reference["tf_logprob"], abs=1e-2)


def test_steered_tokens_and_drift(run):
    _, results, arms = run
    for row in arms["always on"]["rows"]:  # every token steered
        assert row["steered"] == row["prompt_tokens"] + row["completion_tokens"]
    assert all(r["steered"] == 0 for r in arms["none"]["rows"])
    assert results["sweeps"]["threshold"][0]["summary"]["benign"]["fired"] == [3, 3]
    none, always = arms["none"]["summary"]["benign"], arms["always on"]["summary"]["benign"]
    assert none["same_as_unsteered"] == [6, 6] and none["first_divergence_median"] is None
    for arm in arms.values():
        for label in ("harmful", "benign"):
            ppl = arm["summary"][label]["perplexity"]
            assert math.isfinite(ppl) and ppl >= 1.0
    # The unsteered reply is the unsteered model's greedy output: its own baseline, nearly
    # all top-1; steering every token moves the model off it.
    assert none["top1"] > 0.9
    assert always["perplexity"] > none["perplexity"] and always["top1"] < none["top1"]
    assert always["same_as_unsteered"][0] < 6
