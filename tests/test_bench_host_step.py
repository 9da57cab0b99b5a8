"""benchmarks/host_step.py: versions alternated in fresh processes, with a speed control."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_step

ROOT = Path(__file__).resolve().parents[1]


def test_a_time_is_scaled_by_the_probe_taken_before_it(monkeypatch):
    control = host_step.SpeedControl()
    clock = iter([0, int(2 * host_step.CONTROL_NS * host_step.CONTROL_WORK)])
    monkeypatch.setattr(host_step.time, "perf_counter_ns", lambda: next(clock))
    control.probe()  # the work took twice the control speed's time: the host runs at half

    assert control.probes[-1] == pytest.approx(2 * host_step.CONTROL_NS)
    assert control.scaled(1e-3) == pytest.approx(0.5e-3)


def test_a_baseline_copy_alternates_with_the_installed_code_and_both_carry_the_control(
        tmp_path):
    baseline = tmp_path / "baseline"
    for name in host_step.PACKAGES:
        shutil.copytree(ROOT / name, baseline / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_step.py"), "--out", str(out),
         "--steps", "20", "--requests", "2", "--scenarios", "mixed", "--profile", "mixed",
         "--profile-requests", "2", "--rounds", "2", "--baseline", str(baseline),
         "--control"],
        check=True, capture_output=True, text=True, timeout=600)
    result = json.loads((out / "host_step.json").read_text())

    rows = {"mixed", "mixed fill CPU", "mixed at control speed", "mixed control ns"}
    for version in ("baseline", "current"):
        assert set(result["versions"][version]) == rows
        for row in rows:
            cell = result["versions"][version][row]["2"]
            assert 0 < cell["range"][0] <= cell["median"] <= cell["range"][1]
    assert all(len(result["ratios"][row]["2"]) == 2 for row in rows)  # paired per round
    for version in ("baseline", "current"):  # scaled by the probes: the same order of size
        raw = result["versions"][version]["mixed"]["2"]["median"]
        scaled = result["versions"][version]["mixed at control speed"]["2"]["median"]
        probe = result["versions"][version]["mixed control ns"]["2"]["median"]
        assert scaled == pytest.approx(raw * host_step.CONTROL_NS / probe, rel=0.8)
