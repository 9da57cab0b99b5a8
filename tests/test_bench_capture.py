"""``benchmarks/capture.py``'s summary, without an engine: medians and ratios to stock."""

from __future__ import annotations

import pytest
from capture import summarize


def test_ratios_are_to_stock_in_the_same_batch_and_stock_prefill():
    runs = {"stock@32": [{"tokens_per_s": 100.0}, {"tokens_per_s": 120.0},
                         {"tokens_per_s": 110.0}],
            "plain@32": [{"tokens_per_s": 109.0}] * 3,
            "returned-1@32": [{"tokens_per_s": 99.0}] * 3,
            "sink-4@32": [{"tokens_per_s": 88.0, "sink_mb_per_s": 50.0}] * 3,
            "stock-prefill": [{"tokens_per_s": 1000.0}],
            "training": [{"tokens_per_s": 600.0}]}
    table = summarize(runs, [32])
    assert table["plain@32"]["ratio"] == pytest.approx(109 / 110)
    assert table["sink-4@32"]["sink_mb_per_s"] == 50.0
    assert table["training"]["ratio"] == pytest.approx(0.6)


def test_vllm_lens_rows_are_to_stock_and_to_its_own_eager_engine():
    runs = {"stock@8": [{"tokens_per_s": 100.0}], "plain@8": [{"tokens_per_s": 100.0}],
            "returned-1@8": [{"tokens_per_s": 90.0}],
            "sink-4@8": [{"tokens_per_s": 80.0, "sink_mb_per_s": 5.0}],
            "stock-prefill": [{"tokens_per_s": 1000.0}], "training": [{"tokens_per_s": 900.0}],
            "lens-plain@8": [{"tokens_per_s": 80.0}], "lens-returned-1@8": [{"tokens_per_s": 60.0}],
            "lens-returned-4@8": [{"tokens_per_s": 40.0}],
            "lens-prefill": [{"tokens_per_s": 800.0}], "lens-training": [{"tokens_per_s": 400.0}]}
    table = summarize(runs, [8], lens=True)
    assert table["lens-returned-1@8"] == pytest.approx({"tokens_per_s": 60.0, "ratio": 0.6,
                                                        "own": 0.75})
    assert table["lens-returned-4@8"]["own"] == pytest.approx(0.5)
    assert table["lens-training"] == pytest.approx({"tokens_per_s": 400.0, "ratio": 0.4,
                                                    "own": 0.5})
    assert "lens-plain@8" not in summarize(runs, [8])
