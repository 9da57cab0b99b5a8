"""Per-request gate telemetry and the prefix-guard report, folded per step in whole arrays.

A step's host work must not grow with the number of requests in it (issue: serving at batch
256), so nothing here loops over requests per step. Each gated request owns a *record* (mapped
from the runner's request slot when a step starts) and every counter is a per-record numpy
array, updated for all tokens of
a step at once with ``bincount`` / ``minimum.at`` / ``maximum.at``. Python work per request
happens at admission and finish only; per step, only for requests that asked for a full gate
trace (``"trace": true`` in their gate) and for the few requests whose cacheable prefix grew
by a whole KV block (the report the scheduler needs; about one request in ``block_size`` per
decode step).

Read-back: the gates and scores of a step live in one ``[2, T]`` device buffer. At the start
of the next step (before its forward is launched) one non-blocking copy of the step's part goes
to a preallocated pinned ring slot; it is folded once its event completed, never by waiting on
the hot path. A finished request keeps its record until the steps it ran in are folded (the
runner may give its slot to a new request at once), so finishing never waits for the GPU
either. A query (``report``) drains everything, waiting if it must.

Controllers (:mod:`.controllers`): a step with controlled tokens also copies the controller
table (one more small DMA) and, once folded, is handed to the ``observer`` with the table as it
was during the step; :meth:`GateTelemetry.fold_until` folds every step up to a given number,
waiting if it must (the Python controllers' fixed lag makes that wait free in practice).

Positions counted are the ones the engine processed: the prompt (less prefix-cache hits) and
every generated token but the last (never fed back). A position recomputed after preemption
is counted once (tokens below the record's processed frontier are skipped by the counters).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..compat.worker import is_internal_id_of
from ..prefix_guard.guard import DYNAMIC_EPSILON, NONE, grown_frontiers

GATE_ON = 0.5
"""A token counts as gated when its gate is above this."""
RING = 4
"""Pinned read-back buffers; a fifth step in flight waits for the oldest copy."""

_COUNTERS = ("monitored", "gated_prefill", "gated_decode", "first_decode_gated", "max_score",
             "first_dynamic", "upto")


@dataclass
class _Request:
    record: int
    prompt_len: int
    site: int
    dynamic_from: int
    trace: bool
    counters: tuple[Any, ...] | None = None
    """The record's counters, saved when the request left the engine (restored on resume)."""
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

    def __init__(self, values: torch.Tensor, sites: list[str], block_size: int,
                 max_slots: int, keep: int = 4096, control: torch.Tensor | None = None) -> None:
        self._values = values
        """The op's ``[2, max_tokens]`` gate/score buffer (row 0 gates, row 1 scores)."""
        self._control = control
        """The controller table (:mod:`.control`), copied with controlled steps."""
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
        self._block = block_size
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
        self._record_of_slot = np.zeros(max_slots, dtype=np.int64)
        """The runner's request slot -> the record of the request holding it."""
        self._req_of_record: list[str | None] = []
        """Live request id of each record (None: free, or its request finished)."""
        self._request_of_record: list[_Request | None] = []
        self._free_records: list[int] = []
        self._steps_started = 0
        self._steps_folded = 0
        self._retiring: deque[tuple[int, str, _Request]] = deque()
        """Finished requests whose steps are not all folded: (steps started, id, request)."""
        self._traced = 0
        self._site_monitored = np.zeros(len(sites), dtype=np.int64)
        self._site_gated = np.zeros(len(sites), dtype=np.int64)
        self._grow(max_slots)

    # ---- lifecycle (once per request) ------------------------------------------------------
    def admit(self, req_id: str, slot: int, prompt_len: int, site: str,
              dynamic_from: int | None, trace: bool, session: str | None = None) -> None:
        """Start a record for the request in runner slot ``slot`` (a resumed request continues
        its old one)."""
        if any(rid == req_id for _, rid, _ in self._retiring):
            self.drain()  # resumed before its last steps were folded (rare)
        if not self._free_records:
            self._grow(2 * len(self._req_of_record))
        record = self._free_records.pop()
        if slot >= len(self._record_of_slot):
            grown = np.zeros(max(slot + 1, 2 * len(self._record_of_slot)), dtype=np.int64)
            grown[: len(self._record_of_slot)] = self._record_of_slot
            self._record_of_slot = grown
        self._record_of_slot[slot] = record
        old = self._done.pop(req_id, None)
        req = old or _Request(record, prompt_len, self._sites.index(site),
                              NONE if dynamic_from is None else dynamic_from, trace)
        req.record, req.req_id, req.session = record, req_id, session
        self._reset(record, req)
        self._live[req_id] = req
        self._req_of_record[record] = req_id
        self._request_of_record[record] = req
        self._name[record], self._session[record] = req_id, session
        self._traced += req.trace

    def finish(self, req_id: str) -> None:
        """The request left the engine; its counters are kept once its last step is folded."""
        req = self._live.pop(req_id, None)
        if req is None:
            return
        self._req_of_record[req.record] = None  # no more prefix-guard reports
        if self._steps_folded == self._steps_started:
            self._retire(req_id, req)
        else:
            self._retiring.append((self._steps_started, req_id, req))

    def _retire(self, req_id: str, req: _Request) -> None:
        req.counters = tuple(getattr(self, f"_{name}")[req.record].copy()
                             for name in _COUNTERS)
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
    def before_step(self, index: np.ndarray, slot: np.ndarray, pos: np.ndarray,
                    tokens: int, control_rows: np.ndarray | None = None) -> None:
        """Before each forward: this step's gated tokens (indices into the step, their slots
        and positions; empty when no gated request runs), the step's token count and the
        tokens' controller rows (None when no token has a controller)."""
        self._launch_copy()
        self._fold(wait=False)
        number, self.steps = self.steps, self.steps + 1
        if len(index):
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
        """Requests whose cacheable prefix grew by a whole block: (positions processed, first
        dynamically steered position or None). The scheduler caches only blocks below the
        first dynamic position (or, while there is none, below ``processed``)."""
        self._launch_copy()
        self._fold(wait=False)
        grown = grown_frontiers(self._upto, self._first_dynamic, self._reported, self._block)
        report = {}
        for record in grown.tolist():
            req_id = self._req_of_record[record]
            if req_id is not None:
                first = int(self._first_dynamic[record])
                report[req_id] = (int(self._upto[record]), None if first == NONE else first)
        return report

    # ---- queries -------------------------------------------------------------------------
    def drain(self) -> None:
        """Fold every pending step in (waits for outstanding copies)."""
        self._launch_copy()
        self._fold(wait=True)

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
        return {s: int(n) for s, n in zip(self._sites, self._site_monitored, strict=True) if n}

    @property
    def tokens_gated(self) -> dict[str, int]:
        """Per monitor site: tokens whose gate was above :data:`GATE_ON`."""
        return {s: int(n) for s, n in zip(self._sites, self._site_gated, strict=True) if n}

    # ---- internals -----------------------------------------------------------------------
    def _grow(self, size: int) -> None:
        old = len(self._req_of_record)
        self._req_of_record += [None] * (size - old)
        self._request_of_record += [None] * (size - old)
        self._free_records[:0] = range(size - 1, old - 1, -1)
        for name, dtype, fill in (("prompt_len", np.int64, 0), ("dynamic_from", np.int64, NONE),
                                  ("site", np.int64, 0), ("trace", bool, False),
                                  ("monitored", np.int64, 0), ("gated_prefill", np.int64, 0),
                                  ("gated_decode", np.int64, 0),
                                  ("first_decode_gated", np.int64, NONE),
                                  ("max_score", np.float32, np.nan),
                                  ("first_dynamic", np.int64, NONE), ("upto", np.int64, 0),
                                  ("reported", np.int64, 0), ("win_tokens", np.int64, 0),
                                  ("win_gated", np.int64, 0), ("win_max", np.float32, np.nan),
                                  ("name", object, None), ("session", object, None)):
            new = np.full(size, fill, dtype=dtype)
            if old:
                new[:old] = getattr(self, f"_{name}")
            setattr(self, f"_{name}", new)

    def _reset(self, record: int, req: _Request) -> None:
        self._prompt_len[record] = req.prompt_len
        self._dynamic_from[record] = req.dynamic_from
        self._site[record] = req.site
        self._trace[record] = req.trace
        fresh = (0, 0, 0, NONE, np.nan, NONE, 0)
        for name, value in zip(_COUNTERS, req.counters or fresh, strict=True):
            getattr(self, f"_{name}")[record] = value
        self._reported[record] = 0  # a resumed request re-reports its clean prefix
        self._win_tokens[record], self._win_gated[record], self._win_max[record] = 0, 0, np.nan

    def launch_copy(self) -> None:
        """Queue the read-back of the last step begun (no-op when there is none)."""
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
            step.event.record()
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
            while self._retiring and self._retiring[0][0] <= self._steps_folded:
                self._retire(*self._retiring.popleft()[1:])
            done += 1

    def _fold_step(self, step: _Step, gates: np.ndarray, scores: np.ndarray) -> None:
        slot, pos = step.record, step.pos  # a finished request's record waits for this fold
        sites = self._site[slot]
        on = gates > GATE_ON
        self._site_monitored += np.bincount(sites, minlength=len(self._sites))
        self._site_gated += np.bincount(sites, weights=on, minlength=len(self._sites)).astype(
            np.int64)
        new = pos >= self._upto[slot]  # recomputed positions were counted the first time
        s, p, on_new = slot[new], pos[new], on[new]
        size = len(self._req_of_record)
        prompt = p < self._prompt_len[s]
        self._monitored += np.bincount(s, minlength=size)
        self._gated_prefill += np.bincount(s, weights=on_new & prompt, minlength=size).astype(
            np.int64)
        self._gated_decode += np.bincount(s, weights=on_new & ~prompt, minlength=size).astype(
            np.int64)
        decode_on = on_new & ~prompt
        np.minimum.at(self._first_decode_gated, s[decode_on], p[decode_on])
        np.fmax.at(self._max_score, slot, scores)
        hot = (gates > DYNAMIC_EPSILON) & (pos >= self._dynamic_from[slot])
        np.minimum.at(self._first_dynamic, slot[hot], pos[hot])
        np.maximum.at(self._upto, slot, pos + 1)
        if self._traced:
            traced = self._trace[slot]
            for one in np.unique(slot[traced]).tolist():
                self._put_trace(one, pos, gates, scores, slot == one)
        if step.control is not None and self.observer is not None:
            self.observer(step.number, slot, pos, gates, scores, step.control_rows, step.control)
        if self.events is not None:
            self._summarize(step.number, s, on_new, scores[new])

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
        """Positions of the record's request folded so far."""
        return int(self._upto[record])

    def mark_dynamic(self, record: int, position: int) -> None:
        """KV from ``position`` on is computed under steering the request's cache key does
        not describe (a controller switched or stopped its steering): never share it."""
        self._first_dynamic[record] = min(int(self._first_dynamic[record]), position)

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
        values = req.counters or tuple(getattr(self, f"_{n}")[req.record] for n in _COUNTERS)
        counts = dict(zip(_COUNTERS, values, strict=True))
        first_decode = int(counts["first_decode_gated"])
        max_score = float(counts["max_score"])
        gates = scores = None
        if req.trace:
            n = int(counts["upto"])
            gates, scores = (_trace_list(t, n) for t in (req.gates, req.scores))
        return {
            "tokens_monitored": int(counts["monitored"]),
            "gated_prefill": int(counts["gated_prefill"]),
            "gated_decode": int(counts["gated_decode"]),
            "first_decode_gated": None if first_decode == NONE else first_decode - req.prompt_len,
            "max_score": max_score if np.isfinite(max_score) else None,
            "gates": gates,
            "scores": scores,
            "controller": req.controller,
        }


def _trace_list(trace: np.ndarray | None, n: int) -> list[float | None]:
    """A per-position trace as JSON values, ``n`` long (None: not monitored)."""
    trace = trace if trace is not None else np.zeros(0, np.float32)
    trace = np.concatenate([trace, np.full(max(0, n - len(trace)), np.nan)])[:n]
    return [None if np.isnan(v) else float(v) for v in trace]
