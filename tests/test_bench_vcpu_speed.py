"""benchmarks/vcpu_speed.py: each CPU probed in turn with the same interpreter work."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import vcpu_speed


def test_every_cpu_is_probed_each_round_and_the_affinity_is_given_back():
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    result = vcpu_speed.speed_map(cpus, rounds=3, n=2000)

    assert os.sched_getaffinity(0) == allowed
    assert sorted(map(int, result["cpus"])) == cpus
    for row in result["cpus"].values():
        offsets = [t for t, _ in row["probes"]]
        assert len(offsets) == 3 and offsets == sorted(offsets)  # a probe a round, in turn
        assert all(ns > 0 for _, ns in row["probes"])
        assert row["slowest_relative"] >= row["relative"] > 0
    relatives = sorted(row["relative"] for row in result["cpus"].values())
    if len(relatives) % 2:  # the median CPU is the yardstick
        assert relatives[len(relatives) // 2] == pytest.approx(1.0)


def test_the_work_is_fixed_and_the_cli_refuses_a_cpu_it_may_not_use(tmp_path, monkeypatch,
                                                                     capsys):
    assert vcpu_speed.work(5000) == vcpu_speed.work(5000)
    out = tmp_path / "map.json"
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setattr(sys, "argv", ["vcpu_speed.py", "--cpus", str(cpu), "--rounds", "2",
                                      "--work", "1000", "--json", str(out)])
    vcpu_speed.main()
    assert json.loads(out.read_text())["cpus"][str(cpu)]["relative"] == pytest.approx(1.0)
    assert "ns/round" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["vcpu_speed.py", "--cpus", "4095"])
    with pytest.raises(SystemExit):
        vcpu_speed.main()
