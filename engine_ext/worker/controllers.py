"""Per-request controllers in one worker: admission, Python controllers' steps, the record of
what every controller did, and the checksum that shows ranks agree.

Built-in controllers run on the device (:mod:`.control`, :func:`.ops.control_step`); here they
are only admitted and watched. Python controllers (:class:`dynsteer.controller.controllers.
Controller`) are called here, once per step and controller class, with a vectorized view of the
step that ran :data:`~dynsteer.controller.controllers.PYTHON_LAG` steps earlier; their actions
become row writes (floor, scale) or row switches before the next forward.

Every rank runs the same steps with the same inputs, so it calls the same controllers with the
same views and applies the same actions; :attr:`ControllerRunner.checksum` (a CRC chained over
every folded step's controller state and every applied action) is what a caller compares
across ranks (the info RPC and ``/metrics``). Nothing here talks to other ranks.

Per step, the host work is whole-array numpy over the step's controlled tokens plus a Python
call per controller class; Python loops run only over requests whose mode *changed* (floor, or
scale to or from zero: an event for the telemetry report, a few per request) or that got an
action.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynsteer.controller.controllers import (
    DECODE,
    PREFILL,
    PYTHON_LAG,
    Action,
    Actions,
    BuiltinController,
    Controller,
    StepView,
    controller_class,
)

from .control import ControlTable
from .layout import CTL_FLOOR, CTL_SCALE

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

MAX_EVENTS = 64
"""Events kept per request in its telemetry report (the first ones; a counter has them all)."""
CHECKSUM_LOG = 64
"""Folded steps whose per-step checksum ``info`` lists (``controller_checksum_log``)."""


@dataclass
class _Stats:
    requests: int = 0
    calls: int = 0
    seconds: float = 0.0
    errors: int = 0


@dataclass
class _Live:
    """A live request with a Python controller."""

    req_id: str
    slot: int
    row: int
    name: str


@dataclass
class _Pending:
    """A folded step's tokens of Python-controlled requests, waiting for their turn."""

    number: int
    handle: np.ndarray
    session: np.ndarray
    phase: np.ndarray
    position: np.ndarray
    score: np.ndarray
    gate: np.ndarray
    names: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Index of each token's controller class in the runner's list."""


class ControllerRunner:
    """Controllers of one worker; see the module docstring."""

    def __init__(self, control: ControlTable, telemetry: Any,
                 on_switch: Callable[[str, Action, str | None], None]) -> None:
        self.control = control
        self._telemetry = telemetry
        self._on_switch = on_switch
        """``on_switch(req_id, action, name)``: the state re-resolves the request's rows."""
        self.stats: dict[str, _Stats] = {}
        self.checksum = 0
        self.checked_steps = 0
        self.checksum_log: deque[tuple[int, str, int]] = deque(maxlen=CHECKSUM_LOG)
        """The last folded steps' (number, CRC of that step's controller state, how many rows
        have a nonzero floor or scale): where two ranks' checksums part, the first step that
        differs."""
        self._instances: dict[str, Controller] = {}
        self._names: list[str] = []
        size = control.rows + 1
        self._handle = np.zeros(size * 4, dtype=np.int64)
        """Per telemetry record: the request's handle (0: no Python controller)."""
        self._class = np.full(size * 4, -1, dtype=np.int64)
        self._session = np.zeros(size * 4, dtype=np.int64)
        self._prompt_len = np.zeros(size * 4, dtype=np.int64)
        self._seen = np.zeros((size * 4, 2), dtype=np.float32)
        """Per record: the (floor, scale) last seen in a folded step (events are changes)."""
        self._next_handle = 1
        self._live: dict[int, _Live] = {}
        """Python-controlled requests by handle."""
        self._handle_of: dict[str, int] = {}
        self._pending: deque[_Pending] = deque()
        self._sessions: dict[str, list[int]] = {}
        """Session name -> [code, live requests]."""
        self._session_names: dict[int, str] = {}

    @property
    def python_live(self) -> bool:
        return bool(self._live)

    # ---- lifecycle ---------------------------------------------------------------------
    def admit(self, req_id: str, slot: int, record: int, name: str, params: Any,
              session: str | None, prompt_len: int) -> int:
        """Start the request's controller; returns its control row (0: none, it runs with
        its plain gate)."""
        req = self._telemetry.request_of_record(record)
        try:
            cls = controller_class(name)
            params = cls.Params.model_validate(params)
        except ValueError as e:  # the frontend checked it; a worker may differ (install)
            logger.error("dynsteer: request %s runs with its plain gate: %s", req_id, e)
            return 0
        self._grow(record)
        stats = self.stats.setdefault(name, _Stats())
        stats.requests += 1
        if issubclass(cls, BuiltinController):
            floor, scale = cls.initial_state(params)
            row = self.control.admit(slot, cls.kind, floor, scale, cls.device_params(params))
        else:
            floor, scale = 0.0, 1.0
            row = self.control.admit(slot, 0, floor, scale, (np.nan,) * 3)
        if row == 0:
            return 0
        if req is not None:
            req.controller = {"name": name, "events": [], "events_total": 0, "error": None}
        self._seen[record] = (floor, scale)
        self._prompt_len[record] = prompt_len
        self._session[record] = self._session_code(session)
        if not issubclass(cls, BuiltinController):
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            instance = self._instance(name, cls)
            try:
                instance.admit(handle, params, session)
            except Exception as e:  # a third party's bug must not fail the step
                self._fail(name, [handle], record_ids=[record], error=e, live=False)
                return row
            self._handle[record] = handle
            self._class[record] = self._names.index(name)
            self._live[handle] = _Live(req_id, slot, row, name)
            self._handle_of[req_id] = handle
        return row

    def finish(self, req_id: str, record: int, row: int) -> None:
        self.control.release(row)
        self._release_session(int(self._session[record]))
        handle = self._handle_of.pop(req_id, None)
        if handle is None:
            return
        live = self._live.pop(handle)
        try:
            self._instances[live.name].finish(handle)
        except Exception as e:
            logger.error("dynsteer: controller %s failed in finish: %r", live.name, e)

    # ---- per step ----------------------------------------------------------------------
    def observe(self, number: int, records: np.ndarray, pos: np.ndarray, gates: np.ndarray,
                scores: np.ndarray, control_rows: np.ndarray, control: np.ndarray) -> None:
        """A folded step (see :class:`..telemetry.GateTelemetry`): events, checksum, and the
        Python controllers' share of it."""
        mine = control_rows != 0
        if not mine.any():
            return
        recs, rows = records[mine], control_rows[mine]
        state = np.ascontiguousarray(control[:, CTL_FLOOR:CTL_SCALE + 1])
        data = state.tobytes()
        self.checksum = zlib.crc32(data, self.checksum)
        self.checked_steps += 1
        self.checksum_log.append((number, f"{zlib.crc32(data):08x}",
                                  int(np.count_nonzero(state.any(axis=1)))))
        first_recs, first = np.unique(recs, return_index=True)
        values = state[rows[first]]
        seen = self._seen[first_recs]
        # An event is a change of mode: the floor, or the scale to or from 0 (``proportional``
        # moves its scale every step; its gates are in the trace when asked for); for Python
        # controllers every change, each being an action they chose.
        changed = np.flatnonzero((values[:, 0] != seen[:, 0])
                                 | ((values[:, 1] == 0) != (seen[:, 1] == 0))
                                 | ((values[:, 1] != seen[:, 1])
                                    & (self._class[first_recs] >= 0)))
        for i in changed.tolist():
            self._event(int(first_recs[i]), int(pos[mine][first[i]]),
                        {"floor": float(values[i, 0]), "scale": float(values[i, 1])})
        self._seen[first_recs] = values
        python = self._class[recs] >= 0
        if python.any():
            p = np.flatnonzero(mine)[python]
            r = records[p]
            self._pending.append(_Pending(
                number, self._handle[r], self._session[r],
                np.where(pos[p] < self._prompt_len[r], PREFILL, DECODE).astype(np.int8),
                pos[p], scores[p], gates[p], self._class[r]))

    def before_step(self, number: int) -> None:
        """Before step ``number`` is filled: run the Python controllers on the step numbered
        ``number - PYTHON_LAG`` (and any earlier one not run yet) and apply their actions."""
        if not self._live:
            self._pending.clear()
            return
        due = number - PYTHON_LAG
        self._telemetry.fold_until(due)
        while self._pending and self._pending[0].number <= due:
            self._run(self._pending.popleft())

    # ---- internals ---------------------------------------------------------------------
    def _run(self, step: _Pending) -> None:
        live = np.fromiter(self._live, dtype=np.int64, count=len(self._live))
        keep = np.isin(step.handle, live)
        for index in np.unique(step.names[keep]).tolist():
            name = self._names[index]
            sel = keep & (step.names == index)
            view = StepView(step.number, step.handle[sel], step.session[sel], step.phase[sel],
                            step.position[sel], step.score[sel], step.gate[sel],
                            self._session_names)
            stats = self.stats[name]
            start = time.perf_counter()
            try:
                actions = self._instances[name].step(view)
                actions = (Actions() if actions is None else actions).check()
            except Exception as e:
                handles = np.unique(view.request).tolist()
                self._fail(name, handles, None, e, live=True)
                continue
            finally:
                stats.calls += 1
                stats.seconds += time.perf_counter() - start
            self._apply(name, actions)

    def _apply(self, name: str, actions: Actions) -> None:
        ok = np.fromiter((h in self._live and self._live[h].name == name
                          for h in actions.request.tolist()), dtype=bool, count=len(actions))
        if not ok.any():
            return
        handles, codes, values = actions.request[ok], actions.action[ok], actions.value[ok]
        self.checksum = zlib.crc32(handles.tobytes() + codes.tobytes() + values.tobytes(),
                                   self.checksum)
        # In order, so a request's later action sees its earlier ones.
        rows = np.unique([self._live[h].row for h in handles.tolist()])
        floor, scale = self.control.host_state(rows)
        at = {int(row): i for i, row in enumerate(rows.tolist())}
        for handle, code, value in zip(handles.tolist(), codes.tolist(), values.tolist(),
                                       strict=True):
            i = at[self._live[handle].row]
            if code == Action.ENABLE:
                floor[i], scale[i] = 0.0, 1.0
            elif code == Action.DISABLE:
                scale[i] = 0.0
            elif code == Action.LATCH:
                floor[i] = 1.0
            elif code == Action.SCALE:
                scale[i] = value
            else:
                if code == Action.STOP:
                    scale[i] = 0.0
                target = None if code == Action.STOP else actions.names[int(value)]
                self._switch(handle, Action(code), target)
        self.control.set(rows, floor=floor, scale=scale)

    def _switch(self, handle: int, action: Action, name: str | None) -> None:
        live = self._live[handle]
        try:
            self._on_switch(live.req_id, action, name)
        except (KeyError, ValueError) as e:
            logger.warning("dynsteer: controller %s: %s for request %s failed: %s", live.name,
                           action.name.lower(), live.req_id, e)
            return
        record = self._telemetry.record_of_slot(live.slot)
        self._event(record, None, {"action": action.name.lower(), "name": name})

    def _fail(self, name: str, handles: list[int], record_ids: list[int] | None,
              error: Exception, live: bool) -> None:
        """Disable ``name`` for these requests: their gates keep their last state."""
        self.stats[name].errors += 1
        logger.error("dynsteer: controller %s raised %r; disabled for %d request(s)", name,
                     error, len(handles))
        records = record_ids or []
        for handle in handles:
            entry = self._live.pop(handle, None) if live else None
            if entry is not None:
                self._handle_of.pop(entry.req_id, None)
                records.append(self._telemetry.record_of_slot(entry.slot))
        for record in records:
            req = self._telemetry.request_of_record(record)
            if req is not None and req.controller is not None:
                req.controller["error"] = f"{type(error).__name__}: {error}"
            self._handle[record], self._class[record] = 0, -1

    def _event(self, record: int, position: int | None, what: dict[str, Any]) -> None:
        req = self._telemetry.request_of_record(record)
        if req is None or req.controller is None:
            return
        if position is None:
            position = int(self._telemetry.processed(record))
        req.controller["events_total"] += 1
        if len(req.controller["events"]) < MAX_EVENTS:
            req.controller["events"].append({"position": position, **what})

    def _instance(self, name: str, cls: type[Controller]) -> Controller:
        if name not in self._instances:
            self._instances[name] = cls()
            self._names.append(name)
        return self._instances[name]

    def _session_code(self, session: str | None) -> int:
        if session is None:
            return 0
        entry = self._sessions.get(session)
        if entry is None:
            code = max(self._session_names, default=0) + 1
            entry = self._sessions[session] = [code, 0]
            self._session_names[code] = session
        entry[1] += 1
        return entry[0]

    def _release_session(self, code: int) -> None:
        if code == 0:
            return
        name = self._session_names[code]
        entry = self._sessions[name]
        entry[1] -= 1
        if entry[1] == 0:
            del self._sessions[name], self._session_names[code]

    def _grow(self, record: int) -> None:
        if record < len(self._handle):
            return
        size = max(record + 1, 2 * len(self._handle))
        for name in ("_handle", "_class", "_session", "_prompt_len", "_seen"):
            old = getattr(self, name)
            new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
            if name == "_class":
                new[:] = -1
            new[: len(old)] = old
            setattr(self, name, new)

    def info(self) -> dict[str, Any]:
        return {
            "controllers": {name: vars(s).copy() for name, s in self.stats.items()},
            "controller_checksum": f"{self.checksum:08x}",
            "controller_checked_steps": self.checked_steps,
            "controller_checksum_log": [list(entry) for entry in self.checksum_log],
        }

