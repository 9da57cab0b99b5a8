"""`experiments/traffic_probe.py` end to end, reduced: a real `dynsteer serve` of the embedded
model captures live traffic into a filesystem sink through the global capture; the probe
trained on what the sink holds fires on held-out steered requests and few plain ones."""

from __future__ import annotations

import pytest
from engine_utils import without_inductor

pytestmark = pytest.mark.engine


def test_a_probe_trained_on_captured_traffic_separates_it():
    import traffic_probe

    with without_inductor():
        rates = traffic_probe.main(["--requests", "32", "--max-tokens", "12"])
    assert rates["steered"] >= 0.8 and rates["plain"] <= 0.25, rates
