"""Per-request gate telemetry and the prefix-guard report, without per-step work per request.

A step's host work must not grow with the number of requests in it (issue: serving at batch
256). The counters of every gated request (tokens monitored and gated per phase, first gated
decode position, max score, first dynamically steered position, positions processed) live on
the device (:mod:`.gate_stats`): a fixed fold per step, queued after the forward, updates them,
and the host reads back one small array per step (each slot's processed frontier and first
dynamic position), which is all the prefix-guard report needs; a request's counters come back
once, when it finishes (one gather per step for all that finished), or on a query.

Per-token values reach the host only when something asked for them: requests with a full gate
trace (``"trace": true`` in their gate), controllers (events, checksums, Python controllers:
see :mod:`.controllers`) and monitor events (:mod:`.events`). Then the gates and scores of a
step live in one ``[2, T]`` device buffer; when the step is folded (right after its forward,
or at the start of the next step at the latest) one non-blocking copy of the step's part goes
to a preallocated pinned ring slot; it is folded once its event completed, never by waiting
on the hot path. A finished request keeps its record until the steps it ran in are folded
(the runner may give its slot to a new request at once), so finishing never waits for the GPU
either. A query (``report``) drains everything, waiting if it must.

Controllers (:mod:`.controllers`): a step with controlled tokens also copies the controller
table (one more small DMA) and, once folded, is handed to the ``observer`` with the table as it
was during the step; :meth:`GateTelemetry.fold_until` folds every step up to a given number,
waiting if it must (the Python controllers' fixed lag makes that wait free in practice).

Positions counted are the ones the engine processed: the prompt (less prefix-cache hits) and
every generated token but the last (never fed back). A position recomputed after preemption
is counted once (tokens below the request's processed frontier are skipped by the counters).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..compat.worker import is_internal_id_of
from ..prefix_guard.guard import DYNAMIC_EPSILON, NONE
from ..prefix_guard.report import CleanPrefixReport
from . import cuda_events
from .gate_stats import COUNTERS, GateStats, fresh_column, key_score
from .layout import (
    FIRST_DECODE_GATED,
    FIRST_GATED,
    FRONTIER,
    GATE_ON,
    GATED_DECODE,
    GATED_PREFILL,
    MAX_SCORE,
    MONITORED,
    UPTO,
)
from .step_upload import StepUpload

__all__ = ["DYNAMIC_EPSILON", "GATE_ON", "GateTelemetry"]

RING = 4
"""Pinned read-back buffers of per-token values; a fifth step in flight waits for the
oldest copy."""


@dataclass
class _Request:
    record: int
    slot: int
    prompt_len: int
    site: int
    dynamic_from: int
    trace: bool
    column: np.ndarray | None = None
    """The request's device column (see :mod:`.gate_stats`), read out when it left the
    engine (restored on resume); None while it runs."""
    gates: np.ndarray | None = None
    scores: np.ndarray | None = None
    controller: dict[str, Any] | None = None
    """The controller's name, events and error (see :mod:`.controllers`); None: none."""
    req_id: str = ""
    session: str | None = None


@dataclass
class _Step:
    number: int
    """Steps begun before this one (every step counts, gated or not)."""
    tokens: int
    index: np.ndarray
    """Token indices (into the step) of gated requests' tokens."""
    record: np.ndarray
    pos: np.ndarray
    control_rows: np.ndarray | None = None
    """Controller row of each of those tokens (None: no controlled token)."""
    control: np.ndarray | None = None
    """The controller table as it was during the step (once copied)."""
    buffer: int = -1
    """Pinned ring slot holding the step's copy (GPU)."""
    event: Any = None
    """Completes when the copy has landed (GPU)."""
    host: np.ndarray | None = None
    """The step's values, copied at once (CPU)."""


class GateTelemetry:
    """Gate counters and traces of gated requests; finished ones are kept (bounded)."""

    def __init__(self, values: torch.Tensor, index: torch.Tensor, sites: list[str],
                 block_size: int, max_slots: int, keep: int = 4096,
                 control: torch.Tensor | None = None, upload: StepUpload | None = None
                 ) -> None:
        self._values = values
        """The op's ``[2, max_tokens]`` gate/score buffer (row 0 gates, row 1 scores)."""
        self._control = control
        """The controller table (:mod:`.control`), copied with controlled steps."""
        self._stats = GateStats(index, values, len(sites), max_slots, upload)
        """The counters, on the device (``index`` is the op's token index; ``upload``: the
        step's shared uploads, see :class:`.GateStats`)."""
        self.observer: Any = None
        """Called with every folded step that had controlled tokens (see :mod:`.controllers`):
        ``observer(number, records, positions, gates, scores, control_rows, control)``."""
        self.steps = 0
        """Steps begun (the number the next step gets)."""
        self.events: Any = None
        """Where controller events go (:class:`.events.EngineEvents`; None: nowhere)."""
        self._window_end = 0
        """The step number at which the next monitor summary is due."""
        self._sites = sites
        self._keep = keep
        self._on_host = values.device.type == "cpu"
        if not self._on_host:
            self._ring = [torch.zeros(values.shape, dtype=values.dtype).pin_memory()
                          for _ in range(RING)]
            if control is not None:
                self._control_ring = [torch.zeros(control.shape).pin_memory()
                                      for _ in range(RING)]
        self._next_buffer = 0
        self._pending: _Step | None = None
        self._in_flight: list[_Step] = []
        self._live: dict[str, _Request] = {}
        self._done: OrderedDict[str, _Request] = OrderedDict()
        self._prefix = CleanPrefixReport(max_slots, block_size)
        """The prefix guard's report of the live gated requests (:meth:`cache_report`)."""
        self._record_of_slot = np.zeros(max_slots, dtype=np.int64)
        """The runner's request slot -> the record of the request holding it."""
        self._req_of_record: list[str | None] = []
        """Live request id of each record (None: free, or its request finished)."""
        self._request_of_record: list[_Request | None] = []
        self._free_records: list[int] = []
        self._steps_started = 0
        self._steps_folded = 0
        self._retiring: deque[tuple[int, str, _Request]] = deque()
        """Finished requests whose counters have not landed or whose per-token steps are not
        all folded: (per-token steps started, id, request)."""
        self._retiring_ids: set[str] = set()
        """The ids in ``_retiring`` (an admission asks whether its id is one)."""
        self._traced = 0
        self._grow(max_slots)

    @property
    def wants_tokens(self) -> bool:
        """Whether steps must hand their gated tokens over (traces or monitor events; the
        caller adds steps with controlled tokens)."""
        return bool(self._traced) or self.events is not None

    # ---- lifecycle (once per request) ------------------------------------------------------
    def admit(self, req_id: str, slot: int, prompt_len: int, site: str,
              dynamic_from: int | None, trace: bool, session: str | None = None) -> None:
        """Start a record for the request in runner slot ``slot`` (a resumed request continues
        its old counters)."""
        if req_id in self._retiring_ids:
            self.drain()  # resumed before its counters landed (rare)
        if not self._free_records:
            self._grow(2 * len(self._req_of_record))
        record = self._free_records.pop()
        if slot >= len(self._record_of_slot):
            grown = np.zeros(max(slot + 1, 2 * len(self._record_of_slot)), dtype=np.int64)
            grown[: len(self._record_of_slot)] = self._record_of_slot
            self._record_of_slot = grown
        self._record_of_slot[slot] = record
        old = self._done.pop(req_id, None)
        req = old or _Request(record, slot, prompt_len, self._sites.index(site),
                              NONE if dynamic_from is None else dynamic_from, trace)
        column = fresh_column(req.prompt_len, req.dynamic_from, req.site)
        if req.column is not None:  # resumed: its positions recomputed are not counted again
            column[COUNTERS] = req.column[COUNTERS]
            column[FRONTIER] = req.column[UPTO]
        self._stats.write(slot, column)
        self._upto[record] = column[UPTO]
        req.record, req.slot, req.req_id, req.session = record, slot, req_id, session
        req.column = None
        self._prefix.admit(slot, req_id)
        self._trace[record] = req.trace
        self._win_tokens[record], self._win_gated[record], self._win_max[record] = 0, 0, np.nan
        self._live[req_id] = req
        self._req_of_record[record] = req_id
        self._request_of_record[record] = req
        self._name[record], self._session[record] = req_id, session
        self._traced += req.trace

    def finish(self, req_id: str) -> None:
        """The request left the engine; its counters are kept once they landed and its last
        step is folded."""
        req = self._live.pop(req_id, None)
        if req is None:
            return
        self._req_of_record[req.record] = None
        self._prefix.finish(req.slot, req_id)  # no more prefix-guard reports
        self.launch_copy()  # its last step's fold comes before the read-out
        self._stats.read(req.slot, req)
        self._retiring.append((self._steps_started, req_id, req))
        self._retiring_ids.add(req_id)

    def _retire_landed(self, wait: bool = False) -> None:
        for req, column in self._stats.take(wait):
            req.column = column
        while self._retiring:
            started, req_id, req = self._retiring[0]
            if req.column is None or started > self._steps_folded:
                return
            self._retiring.popleft()
            self._retiring_ids.discard(req_id)
            self._retire(req_id, req)

    def _retire(self, req_id: str, req: _Request) -> None:
        self._request_of_record[req.record] = None
        self._win_tokens[req.record] = 0  # its finished event has everything
        self._free_records.append(req.record)
        self._traced -= req.trace
        self._done[req_id] = req
        if self.events is not None:
            self.events.request_finished(req_id, req.session, self._summary(req))
        while len(self._done) > self._keep:
            self._done.popitem(last=False)

    # ---- per step (whole arrays) ---------------------------------------------------------
    def before_step(self, tokens: int, gated: bool, index: np.ndarray | None = None,
                    slot: np.ndarray | None = None, pos: np.ndarray | None = None,
                    control_rows: np.ndarray | None = None) -> None:
        """Before each forward (and before its index is filled): ``tokens`` in the step,
        whether any is gated, and, when per-token values are wanted (:attr:`wants_tokens`,
        or controlled tokens), the gated tokens' indices into the step, slots and positions
        and their controller rows (None when no token has a controller)."""
        self.launch_copy()
        self._stats.begin_step(tokens, gated)
        if self._in_flight:
            self._fold(wait=False)  # frees ring slots (what landed is retired by the report)
        number, self.steps = self.steps, self.steps + 1
        if index is not None and len(index):
            self._pending = _Step(number, tokens, index, self._record_of_slot[slot], pos,
                                  control_rows)
            self._steps_started += 1

    def fold_until(self, number: int) -> None:
        """Fold every step numbered up to ``number`` (waits for their copies if needed)."""
        if self._pending is not None and self._pending.number <= number:
            self._launch_copy()
        while self._in_flight and self._in_flight[0].number <= number:
            self._fold(wait=True, limit=1)

    def cache_report(self) -> dict[str, tuple[int, int | None]]:
        """The prefix guard's report of this step (:class:`.CleanPrefixReport`): requests
        whose clean prefix grew by a whole block, (positions processed, first dynamically
        steered position or None). The scheduler caches only blocks below the first dynamic
        position (or, while there is none, below ``processed``).

        This runs after every step, so it is also the step's one fold of what landed
        (finished requests' counters, per-token steps)."""
        self.launch_copy()
        if self._in_flight:
            self._fold(wait=False)
        self._retire_landed()  # takes what landed, the newest snapshot included
        return self._prefix.report(self._stats, bool(self._live))

    # ---- queries -------------------------------------------------------------------------
    def drain(self) -> None:
        """Fold every pending step in (waits for outstanding copies)."""
        self.launch_copy()
        self._stats.drain()
        self._fold(wait=True)
        self._retire_landed(wait=True)

    def report(self, req_id: str) -> dict[str, Any] | None:
        """Summary of one request (live or finished), or None if it had no gate.

        ``req_id`` may be the engine's internal id or the caller's id (then the most recent
        internal id of it is taken).
        """
        self.drain()
        req = self._live.get(req_id) or self._done.get(req_id)
        if req is None:
            matches = [r for k, r in [*self._done.items(), *self._live.items()]
                       if is_internal_id_of(k, req_id)]
            req = matches[-1] if matches else None
        return None if req is None else self._summary(req)

    @property
    def tokens_monitored(self) -> dict[str, int]:
        """Per monitor site: tokens whose gate was computed (recomputed ones count again)."""
        counts = self._stats.site_totals()[:, 0]
        return {s: int(n) for s, n in zip(self._sites, counts, strict=True) if n}

    @property
    def tokens_gated(self) -> dict[str, int]:
        """Per monitor site: tokens whose gate was above :data:`GATE_ON`."""
        counts = self._stats.site_totals()[:, 1]
        return {s: int(n) for s, n in zip(self._sites, counts, strict=True) if n}

    # ---- internals -----------------------------------------------------------------------
    def _grow(self, size: int) -> None:
        old = len(self._req_of_record)
        self._req_of_record += [None] * (size - old)
        self._request_of_record += [None] * (size - old)
        self._free_records[:0] = range(size - 1, old - 1, -1)
        for name, dtype, fill in (("trace", bool, False), ("upto", np.int64, 0),
                                  ("win_tokens", np.int64, 0), ("win_gated", np.int64, 0),
                                  ("win_max", np.float32, np.nan), ("name", object, None),
                                  ("session", object, None)):
            new = np.full(size, fill, dtype=dtype)
            if old:
                new[:old] = getattr(self, f"_{name}")
            setattr(self, f"_{name}", new)

    def launch_copy(self) -> None:
        """Fold the step begun last into the counters (queued on the device) and queue its
        per-token read-back (no-op when done already)."""
        self._stats.flush(quiet=self._prefix.settled)  # a settled report reads no snapshot
        self._launch_copy()

    def _launch_copy(self) -> None:
        step, self._pending = self._pending, None
        if step is None:
            return
        part = self._values[:, : step.tokens]
        controlled = step.control_rows is not None and self._control is not None
        if self._on_host:
            step.host = part.numpy().copy()
            if controlled:
                step.control = self._control.numpy().copy()
        else:
            if len(self._in_flight) >= RING:
                self._fold(wait=True, limit=1)
            step.buffer = self._next_buffer
            self._next_buffer = (self._next_buffer + 1) % RING
            host = self._ring[step.buffer]
            for row in range(2):  # contiguous rows: a DMA each (a strided copy would sync)
                host[row, : step.tokens].copy_(part[row], non_blocking=True)
            if controlled:
                ring = self._control_ring[step.buffer]
                ring.copy_(self._control, non_blocking=True)
                step.control = ring.numpy()
            step.event = torch.cuda.Event()
            cuda_events.record(step.event, part.device.index)
        self._in_flight.append(step)

    def _fold(self, wait: bool, limit: int | None = None) -> None:
        done = 0
        while self._in_flight and (limit is None or done < limit):
            step = self._in_flight[0]
            if step.host is not None:
                values = step.host
            else:
                if not wait and not step.event.query():
                    return
                step.event.synchronize()
                values = self._ring[step.buffer][:, : step.tokens].numpy()
            self._in_flight.pop(0)
            self._fold_step(step, values[0, step.index], values[1, step.index])
            self._steps_folded += 1
            done += 1

    def _fold_step(self, step: _Step, gates: np.ndarray, scores: np.ndarray) -> None:
        """A step's per-token values: traces, the controllers' observer, monitor windows."""
        record, pos = step.record, step.pos  # a finished request's record waits for this fold
        new = pos >= self._upto[record]  # recomputed positions were counted the first time
        np.maximum.at(self._upto, record, pos + 1)
        if self._traced:
            traced = self._trace[record]
            for one in np.unique(record[traced]).tolist():
                self._put_trace(one, pos, gates, scores, record == one)
        if step.control is not None and self.observer is not None:
            self.observer(step.number, record, pos, gates, scores, step.control_rows,
                          step.control)
        if self.events is not None:
            self._summarize(step.number, record[new], gates[new] > GATE_ON, scores[new])

    def _summarize(self, number: int, records: np.ndarray, on: np.ndarray,
                   scores: np.ndarray) -> None:
        """Add a folded step to the monitor window; publish the window once it is full."""
        size = len(self._req_of_record)
        self._win_tokens += np.bincount(records, minlength=size)
        self._win_gated += np.bincount(records, weights=on, minlength=size).astype(np.int64)
        np.fmax.at(self._win_max, records, scores)
        if number < self._window_end:
            return
        self._window_end = number + self.events.every
        recs = np.flatnonzero(self._win_tokens)
        # Ids by array gather (records keep them until retired), not a Python loop.
        self.events.monitor(number, self._name[recs].tolist(), self._session[recs].tolist(),
                            self._win_tokens[recs], self._win_gated[recs], self._win_max[recs])
        self._win_tokens[recs], self._win_gated[recs], self._win_max[recs] = 0, 0, np.nan

    def request_of_record(self, record: int) -> _Request | None:
        """The request a record holds (live, or finished with steps still to fold)."""
        return self._request_of_record[record]

    def record_of_slot(self, slot: int) -> int:
        return int(self._record_of_slot[slot])

    def processed(self, record: int) -> int:
        """Positions of the record's request folded so far (per-token steps: a controlled
        request's)."""
        return int(self._upto[record])

    def mark_dynamic(self, slot: int, position: int) -> None:
        """KV from ``position`` on is computed under steering the request's cache key does
        not describe (a controller switched or stopped its steering): never share it."""
        self._stats.lower_first_dynamic(slot, position)

    def _put_trace(self, record: int, pos: np.ndarray, gates: np.ndarray, scores: np.ndarray,
                   mask: np.ndarray) -> None:
        req = self._request_of_record[record]
        assert req is not None
        end = int(pos[mask].max()) + 1
        if req.gates is None or end > len(req.gates):
            size = max(end, 2 * (0 if req.gates is None else len(req.gates)))
            grown = np.full((2, size), np.nan, dtype=np.float32)
            if req.gates is not None:
                grown[0, : len(req.gates)], grown[1, : len(req.gates)] = req.gates, req.scores
            req.gates, req.scores = grown[0], grown[1]
        req.gates[pos[mask]] = gates[mask]  # a recomputed position overwrites
        req.scores[pos[mask]] = scores[mask]

    def _summary(self, req: _Request) -> dict[str, Any]:
        column = req.column if req.column is not None else self._stats.column(req.slot)
        first_decode = int(column[FIRST_DECODE_GATED])
        first = int(column[FIRST_GATED])
        max_score = key_score(int(column[MAX_SCORE]))
        gates = scores = None
        if req.trace:
            n = int(column[UPTO])
            gates, scores = (_trace_list(t, n) for t in (req.gates, req.scores))
        return {
            "tokens_monitored": int(column[MONITORED]),
            "gated_prefill": int(column[GATED_PREFILL]),
            "gated_decode": int(column[GATED_DECODE]),
            "first_decode_gated": None if first_decode == NONE else first_decode - req.prompt_len,
            "first_gated": None if first == NONE else first,
            "max_score": max_score if max_score is not None and np.isfinite(max_score) else None,
            "gates": gates,
            "scores": scores,
            "controller": req.controller,
        }


def _trace_list(trace: np.ndarray | None, n: int) -> list[float | None]:
    """A per-position trace as JSON values, ``n`` long (None: not monitored)."""
    trace = trace if trace is not None else np.zeros(0, np.float32)
    trace = np.concatenate([trace, np.full(max(0, n - len(trace)), np.nan)])[:n]
    return [None if np.isnan(v) else float(v) for v in trace]
