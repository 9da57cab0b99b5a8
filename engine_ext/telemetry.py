"""Per-request gate telemetry, read back from the per-token gate/score buffers.

Only steps that contain a gated request pay anything: at the start of the next step (before
its forward is launched, so the buffers still hold the previous step's values) one
non-blocking device-to-host copy of the used part of ``gate``/``score`` is queued; it is folded
into per-request arrays once its event has completed, never by waiting on the hot path. A query
(``report``) drains everything, waiting if it must.

Positions covered are the ones the engine processed: the prompt (less any prefix-cache hit)
and every generated token but the last (which is never fed back).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

GATE_ON = 0.5
"""A token counts as gated when its gate is above this."""
DYNAMIC_EPSILON = 1e-3
"""A position's KV counts as dynamically steered when its gate is above this (and the gate
steers that position's phase): below it the gated entries add under 0.1% of their vector, so
the KV is treated as unsteered and stays shareable through the prefix cache."""


@dataclass
class _Record:
    prompt_len: int
    site: str
    """The monitor site (``hook@layer``), the label of the per-site counters."""
    dynamic_from: int | None = None
    """First position whose phase the gated entries steer (0, the prompt length, or None)."""
    first_dynamic: int | None = None
    """First position whose KV got a dynamic contribution (gate > DYNAMIC_EPSILON)."""
    upto: int = 0
    """Positions below this have been processed and folded in."""
    gate: np.ndarray = field(default_factory=lambda: np.full(0, np.nan, dtype=np.float32))
    score: np.ndarray = field(default_factory=lambda: np.full(0, np.nan, dtype=np.float32))

    def put(self, pos0: int, gate: np.ndarray, score: np.ndarray) -> None:
        end = pos0 + len(gate)
        if end > len(self.gate):
            size = max(end, 2 * len(self.gate))
            self.gate = np.concatenate([self.gate, np.full(size - len(self.gate), np.nan,
                                                           dtype=np.float32)])
            self.score = np.concatenate([self.score, np.full(size - len(self.score), np.nan,
                                                             dtype=np.float32)])
        self.gate[pos0:end] = gate  # a recomputed position (preemption) overwrites
        self.score[pos0:end] = score
        self.upto = max(self.upto, end)
        if self.dynamic_from is not None:
            positions = np.arange(pos0, end)
            hot = np.flatnonzero((positions >= self.dynamic_from) & (gate > DYNAMIC_EPSILON))
            if len(hot):
                first = int(positions[hot[0]])
                self.first_dynamic = (first if self.first_dynamic is None
                                      else min(first, self.first_dynamic))

    def summary(self) -> dict[str, Any]:
        seen = ~np.isnan(self.gate)
        on = seen & (self.gate > GATE_ON)
        pos = np.arange(len(self.gate))
        decode_on = np.flatnonzero(on & (pos >= self.prompt_len))
        return {
            "tokens_monitored": int(seen.sum()),
            "gated_prefill": int((on & (pos < self.prompt_len)).sum()),
            "gated_decode": len(decode_on),
            "first_decode_gated": int(decode_on[0] - self.prompt_len) if len(decode_on) else None,
            "max_score": _json_float(np.nanmax(self.score)) if seen.any() else None,
            "gates": [None if np.isnan(g) else float(g) for g in self.gate],
        }


def _json_float(value: float) -> float | None:
    """``value``, or None when JSON cannot carry it (an overflowing score is inf)."""
    return float(value) if np.isfinite(value) else None


@dataclass
class _Step:
    tokens: int
    spans: list[tuple[str, int, int, int]]
    """(req_id, first token index in the step, token count, first position)."""


class GateTelemetry:
    """Collects gate/score per position for gated requests; keeps finished ones (bounded)."""

    def __init__(self, gate: torch.Tensor, score: torch.Tensor, keep: int = 4096) -> None:
        self._gate = gate
        self._score = score
        self._keep = keep
        self._on_host = gate.device.type == "cpu"
        self._live: dict[str, _Record] = {}
        self._done: OrderedDict[str, _Record] = OrderedDict()
        self._uncopied: _Step | None = None
        self._in_flight: list[tuple[Any, torch.Tensor, _Step]] = []
        self._changed: set[str] = set()
        """Requests folded since the last :meth:`cache_report`."""
        self.tokens_monitored: dict[str, int] = {}
        """Per monitor site: tokens whose gate was computed (recomputed ones count again)."""
        self.tokens_gated: dict[str, int] = {}
        """Per monitor site: tokens whose gate was above :data:`GATE_ON`."""

    def admit(self, req_id: str, prompt_len: int, site: str,
              dynamic_from: int | None = None) -> None:
        """Start (or, for a re-added request such as a resumed one, continue) a record."""
        self._live[req_id] = (self._done.pop(req_id, None)
                              or _Record(prompt_len, site, dynamic_from))

    def before_step(self, spans: list[tuple[str, int, int, int]], tokens: int) -> None:
        """Called before each forward with this step's gated requests (may be empty)."""
        self._launch_copy()
        self._fold(wait=False)
        if spans:
            self._uncopied = _Step(tokens, spans)

    def finish(self, req_id: str) -> None:
        """The request left the engine; its record moves to the bounded finished store."""
        record = self._live.get(req_id)
        if record is None:
            return
        if self._uncopied is not None or self._in_flight:
            self.drain()
        self._done[req_id] = self._live.pop(req_id)
        while len(self._done) > self._keep:
            self._done.popitem(last=False)

    def cache_report(self) -> dict[str, tuple[int, int | None]]:
        """Per live gated request that changed: (positions processed, first dynamic position).

        Called once the step's forward is queued, so the step's own gates are included when
        they are ready (always on CPU; on GPU once the copy queued here has landed, which the
        sampled-token read-back of the same step makes likely). The scheduler caches only
        blocks below ``first dynamic`` (or, while none, below ``processed``).
        """
        self._launch_copy()
        self._fold(wait=False)
        report = {}
        for req_id in self._changed:
            record = self._live.get(req_id)
            if record is not None:
                report[req_id] = (record.upto, record.first_dynamic)
        self._changed.clear()
        return report

    def drain(self) -> None:
        """Fold every pending step in (waits for outstanding copies)."""
        self._launch_copy()
        self._fold(wait=True)

    def report(self, req_id: str) -> dict[str, Any] | None:
        """Summary of one request (live or finished), or None if it had no gate.

        ``req_id`` may be the engine's internal id or the caller's id: vLLM appends ``-`` and 8
        random characters to the latter, so the most recent ``req_id-*`` record is taken.
        """
        self.drain()
        record = self._live.get(req_id) or self._done.get(req_id)
        if record is None:
            prefix = req_id + "-"
            matches = [r for k, r in [*self._done.items(), *self._live.items()]
                       if k.startswith(prefix) and len(k) == len(prefix) + 8]
            record = matches[-1] if matches else None
        return None if record is None else record.summary()

    def _launch_copy(self) -> None:
        step, self._uncopied = self._uncopied, None
        if step is None:
            return
        values = torch.stack([self._gate[: step.tokens], self._score[: step.tokens]])
        if self._on_host:
            self._in_flight.append((None, values.clone(), step))
            return
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((event, host, step))

    def _fold(self, wait: bool) -> None:
        while self._in_flight:
            event, host, step = self._in_flight[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            self._in_flight.pop(0)
            values = host.numpy()
            for req_id, start, count, pos0 in step.spans:
                record = self._live.get(req_id)
                if record is not None:
                    gates = values[0, start:start + count]
                    record.put(pos0, gates, values[1, start:start + count])
                    self._changed.add(req_id)
                    self._count(record.site, gates)

    def _count(self, site: str, gates: np.ndarray) -> None:
        self.tokens_monitored[site] = self.tokens_monitored.get(site, 0) + len(gates)
        gated = int((gates > GATE_ON).sum())
        self.tokens_gated[site] = self.tokens_gated.get(site, 0) + gated
