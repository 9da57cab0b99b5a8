"""Third-party Python controllers for the tests, loaded through the ``dynsteer.controllers``
entry points a test writes next to this file (see ``conftest.controller_plugins``)."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from dynsteer.controller.controllers import Action, Actions, Controller, StepView


class LatchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int = 1


class PyLatch(Controller):
    """The built-in ``latch`` (gate > 0.5 counts) written as a host controller."""

    name, Params = "pylatch", LatchParams

    def __init__(self) -> None:
        self.k: dict[int, int] = {}
        self.count: dict[int, int] = {}

    def admit(self, request: int, params: LatchParams, session: str | None) -> None:
        self.k[request], self.count[request] = params.k, 0

    def finish(self, request: int) -> None:
        del self.k[request], self.count[request]

    def step(self, view: StepView) -> Actions:
        hits = []
        for r in np.unique(view.request).tolist():
            self.count[r] += int((view.gate[view.request == r] > 0.5).sum())
            if self.count[r] >= self.k[r]:
                hits.append(r)
        return Actions.of(hits, Action.LATCH)


class Half(Controller):
    """Halves the gate of every request from the first step it sees on."""

    name = "half"

    def step(self, view: StepView) -> Actions:
        return Actions.of(np.unique(view.request), Action.SCALE, 0.5)


class SwitchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vector: str


class Switcher(Controller):
    """Latches the gate and switches the gated vector to a registered one, once."""

    name, Params = "switcher", SwitchParams

    def __init__(self) -> None:
        self.vector: dict[int, str] = {}

    def admit(self, request: int, params: SwitchParams, session: str | None) -> None:
        self.vector[request] = params.vector

    def finish(self, request: int) -> None:
        self.vector.pop(request, None)

    def step(self, view: StepView) -> Actions:
        ids = [r for r in np.unique(view.request).tolist() if r in self.vector]
        names = tuple(self.vector.pop(r) for r in ids)
        return Actions.of(ids * 2, [Action.LATCH] * len(ids) + [Action.SWITCH_VECTOR] * len(ids),
                          [0.0] * len(ids) + list(range(len(ids))), names=names)


class Raiser(Controller):
    """Raises on its first step."""

    name = "raiser"

    def step(self, view: StepView) -> Actions:
        raise RuntimeError("controller bug")


class MemorySink:
    """A capture sink (entry point group ``dynsteer.capture_sinks``) that keeps what it is
    given, tagged with its argument."""

    def __init__(self, arg: str) -> None:
        self.arg = arg
        self.written: list[tuple[str, object, dict]] = []
        self.counters = {"requests": 0, "dropped": 0, "bytes": 0, "shards": 0}
        self.closed = False

    def write(self, request_id: str, activations: object, meta: dict) -> bool:
        self.written.append((request_id, activations, meta))
        self.counters["requests"] += 1
        return True

    def close(self) -> None:
        self.closed = True
