"""The Python controller ``overhead.py`` runs on every request: a latch written the way a
third party would, vectorized with numpy (loaded through the ``dynsteer.controllers`` entry
point that :func:`install` writes, like any installed package's)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from dynsteer.controller.controllers import Action, Actions, Controller, StepView

SLOTS = 1 << 16
"""Request handles are mapped to counters modulo this (more live requests than that would
share counters; a benchmark has at most a few hundred)."""
K = 4


class NumpyLatch(Controller):
    """Latches a request's gate after ``K`` tokens with gate > 0.5 (one action per request)."""

    name = "bench-latch"

    def __init__(self) -> None:
        self.count = np.zeros(SLOTS, dtype=np.int64)
        self.fired = np.zeros(SLOTS, dtype=bool)

    def admit(self, request: int, params: object, session: str | None) -> None:
        self.count[request % SLOTS], self.fired[request % SLOTS] = 0, False

    def step(self, view: StepView) -> Actions:
        slot = view.request % SLOTS
        np.add.at(self.count, slot[view.gate > 0.5], 1)
        due = (self.count[slot] >= K) & ~self.fired[slot]
        fire = np.unique(view.request[due])
        self.fired[fire % SLOTS] = True
        return Actions.of(fire, Action.LATCH)


def install() -> Path:
    """A folder with this module and its entry point, added as a site directory (where
    ``importlib.metadata`` finds the entry point) and to ``PYTHONPATH`` (engine processes started
    afterwards load it)."""
    import os
    import shutil
    import site

    root = Path(tempfile.mkdtemp(prefix="dynsteer-bench-controllers-"))
    shutil.copy(__file__, root / "bench_controllers.py")
    info = root / "bench_controllers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-controllers\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dynsteer.controllers]\nbench-latch = bench_controllers:NumpyLatch\n")
    site.addsitedir(str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return root
