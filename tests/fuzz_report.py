"""How many fuzz cases a module ran: the issue asks for the number, so each fuzz module writes
it to ``<pytest base temp>/<name>_cases.json`` and prints one line past output capture."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest


def report_cases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 name: str, unit: str, cases: Counter[str], extra: dict[str, Any] | None = None,
                 suffix: str = "") -> None:
    """Write ``cases`` (per test) and their total, plus ``extra``; print a summary line."""
    total = sum(cases.values())
    path = tmp_path_factory.getbasetemp() / f"{name}_cases.json"
    path.write_text(json.dumps({"total": total, "by_test": dict(cases), **(extra or {})}))
    line = f"{name}: {total} {unit} " + ", ".join(f"{k}={v}" for k, v in sorted(cases.items()))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}{suffix} ({path})")
