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
