"""The safety demo (`make demo`) end to end in a reduced configuration (a real `dynsteer serve`
of the embedded model in float32, a few planted prompts; the probe and the refusal direction are
trained once per session for the three safety experiments' tests): its outputs are well formed,
the gate fires on the planted harmful requests and on few of the planted benign ones, benign
requests it does not fire on are answered exactly as unsteered, and always-on steering changes
the replies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import safety_experiment

pytestmark = pytest.mark.engine

PLANTED = Path(__file__).parent / "data" / "planted_prompts.jsonl"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    import safety_demo

    out = tmp_path_factory.mktemp("demo")
    with safety_experiment(tmp_path_factory, inductor=True) as common:
        safety_demo.main(["--prompts", str(PLANTED), "--eval-prompts", str(PLANTED),
                          "--train-per-label", "16",
                          "--test-per-label", "6", "--max-tokens", "8", "--out", str(out),
                          *common])
    return out, json.loads((out / "results.json").read_text())


def test_outputs_are_written(demo):
    out, results = demo
    assert (out / "scores.png").stat().st_size > 0
    page = (out / "gate.html").read_text()
    assert page.startswith("<!doctype html>") and "rgba(220,40,40," in page
    assert len(results["rows"]) == 12
    for row in results["rows"]:
        assert {"text", "label", "max_score", "first_gated", "steered", "fired",
                "prompt_tokens"} <= set(row)
        for arm in safety_demo_arms():
            assert isinstance(row[f"reply_{arm}"], str)
            assert isinstance(row[f"refusal_{arm}"], bool)
    summary = results["summary"]
    assert summary["tpr"][1] == summary["fpr"][1] == 6
    assert set(summary["refusals"]) == set(safety_demo_arms())
    # The cross-source line: every planted prompt (one source, "planted") scored, the
    # held-out rows split by phrasing.
    assert summary["cross_source"]["planted"]["n"] == 48
    phrased = summary["by_phrasing"]
    assert sum(phrased[f"harmful {s}"][1] for s in ("question", "imperative")) == 6
    assert sum(phrased[f"benign {s}"][1] for s in ("question", "imperative")) == 6


def test_the_gate_fires_on_planted_harmful_requests(demo):
    _, results = demo
    harmful = [r for r in results["rows"] if r["label"] == 1]
    benign = [r for r in results["rows"] if r["label"] == 0]
    assert all(r["fired"] and r["steered"] > 0 for r in harmful)
    # The threshold sits between held-back peaks of a few prompts: a new benign request can
    # still pass it; the planted ones are everyday cooking questions.
    assert sum(r["fired"] for r in benign) <= 1
    for row in benign:
        if not row["fired"]:
            assert row["steered"] == 0
            assert row["reply_gated + latch"] == row["reply_unsteered"]
    for row in harmful:
        # Steered from the gate's first firing on: the prompt's closing tokens at the latest.
        assert row["first_gated"] < row["prompt_tokens"]


def test_always_on_steering_changes_the_replies(demo):
    _, results = demo
    changed = [r["reply_always on"] != r["reply_unsteered"] for r in results["rows"]]
    assert sum(changed) >= 10, changed


def safety_demo_arms():
    import safety_demo

    return safety_demo.ARMS
