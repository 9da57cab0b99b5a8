"""The probe sweep by layer and hook in a reduced configuration (a real `dynsteer serve` of the
embedded model, the planted prompts, 2 hooks x 2 layers): every requested site is reported
with AUROCs in [0, 1], the plot is written, and the planted harmful requests are told apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_utils import without_inductor

pytestmark = pytest.mark.engine

PLANTED = Path(__file__).parent / "data" / "planted_prompts.jsonl"
SITES = {"post_attn@10", "post_block@10", "post_attn@15", "post_block@15"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    import probe_layers

    out = tmp_path_factory.mktemp("probe-layers")
    with without_inductor():
        returned = probe_layers.main(["--prompts", str(PLANTED), "--train-per-label", "16",
                                      "--test-per-label", "7", "--layers", "10+15",
                                      "--hooks", "post_attn,post_block", "--out", str(out)])
    return out, json.loads((out / "probe_layers.json").read_text()), returned


def test_outputs_are_well_formed(sweep):
    out, results, returned = sweep
    assert results == returned
    assert (out / "probe_layers.png").stat().st_size > 0
    assert (results["train"], results["test"], results["positives"]) == (32, 14, "suffix")
    assert {row["site"] for row in results["sites"]} == SITES
    for row in results["sites"]:
        assert row["site"] == f"{row['hook']}@{row['layer']}"
        assert 0.0 <= row["auroc_last"] <= 1.0 and 0.0 <= row["auroc_max"] <= 1.0
    for readout in ("last", "max"):
        best = results["best"][readout]
        assert best["site"] in SITES
        assert best["auroc"] == max(row[f"auroc_{readout}"] for row in results["sites"])
        assert 1 <= best["tied"] <= len(SITES)


def test_planted_harmful_requests_are_told_apart(sweep):
    # The planted harmful requests are blatant and the benign ones everyday cooking questions:
    # the middle layers separate them (1.0 measured at every site here, 0.98-1.0 with
    # --positives request; 7 + 7 held-out prompts, so one misordered pair costs 0.02).
    _, results, _ = sweep
    for row in results["sites"]:
        assert min(row["auroc_last"], row["auroc_max"]) >= 0.85, row
    assert results["best"]["last"]["auroc"] >= 0.95 and results["best"]["max"]["auroc"] >= 0.95
