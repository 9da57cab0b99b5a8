"""Requests wait for a steering row instead of running without one.

A worker steers each distinct configuration from a row of its table (``max_rows``) and gates
each distinct probe from a probe row (``max_gates``); a request admitted while every row is
taken would have to run unsteered. So the engine core's scheduler holds such a request back in
its waiting queue until a row is free, and schedules everything that fits meanwhile:

* the frontend, at admission, writes the rows a request will take into its ``extra_args``
  (:func:`claims_for`): one key per steering row (per phase where the phases' contents differ)
  and one per probe row, named by what determines their contents (the spec's hash, the global
  steering it was admitted under, the registry generation), so requests that share a row on
  the workers share a key here;
* the scheduler (:class:`RowBudget`, one per engine core) counts the distinct keys of the
  requests it has scheduled and not yet freed (preempted ones keep theirs: they resume with
  the same rows), and before each step picks the waiting requests whose new keys would not fit
  (:meth:`RowBudget.plan`); they keep their place in the queue.

The count is conservative: two configurations with equal contents share one row on the
workers but count twice here. A request that alone needs more rows than the engine has is
refused at admission (:func:`check_claims`: a clear error naming ``max_rows``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dynsteer.controller.contract import SpecError
from dynsteer.controller.extra_args import CLAIMS_KEY
from dynsteer.controller.positions import MAX_CUTS, cuts
from dynsteer.controller.wire import RawEntry, fingerprint, read_entries

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Claims:
    """The steering rows and probe rows one request takes on every worker while it lives."""

    rows: frozenset[str]
    gates: frozenset[str]

    def to_extra(self) -> dict[str, list[str]]:
        return {"rows": sorted(self.rows), "gates": sorted(self.gates)}


def claims_for(wire: dict[str, Any] | None, global_wire: Sequence[RawEntry],
               global_key: str | None, registry_generation: int) -> Claims | None:
    """What a request (resolved spec ``wire``, admitted under this global steering and
    registry generation) takes on the workers; None: nothing (it runs from row 0)."""
    gate = wire["gate"] if wire else None
    entries = [*global_wire, *(wire["steer"] if wire else ()),
               *(gate["steer"] if gate is not None else ())]
    active = [e for e in read_entries(entries) if e.scale != 0]
    if not active and gate is None:
        return None
    base = fingerprint(wire["key"] if wire else "-", global_key or "-",
                       registry_generation).hex()
    if any(e.positions is not None for e in active):
        # One row per stretch of positions at most (see worker/position_rows.py).
        count = min(2 + sum(cuts(e.positions) for e in active), MAX_CUTS + 2)
        rows = {f"{base}|s{i}" for i in range(count)}
    elif {e.phase for e in active} == {"all"}:
        rows = {f"{base}|all"}  # equal contents in both phases: one row on the workers
    else:
        rows = {f"{base}|{p}" for p in PHASES if any(e.phase in ("all", p) for e in active)}
    return Claims(rows=frozenset(rows), gates=frozenset({base} if gate is not None else ()))


def check_claims(claims: Claims | None, max_rows: int, max_gates: int) -> None:
    """A request that could never be scheduled is refused (SpecError naming the option)."""
    if claims is not None and len(claims.rows) > max_rows:
        raise SpecError(f"dynsteer.max_rows: this request needs {len(claims.rows)} steering "
                        f"rows (its phases steer differently) and the engine has {max_rows}; "
                        "raise the engine option dynsteer.max_rows")
    if claims is not None and len(claims.gates) > max_gates:
        raise SpecError(f"dynsteer.max_gates: the engine has {max_gates} probe rows")


def claims_of(extra_args: dict[str, Any] | None) -> Claims | None:
    """A request's claims as the frontend wrote them (None: it takes no row)."""
    raw = extra_args.get(CLAIMS_KEY) if extra_args else None
    if not isinstance(raw, dict):
        return None
    return Claims(rows=frozenset(raw.get("rows", ())), gates=frozenset(raw.get("gates", ())))


@dataclass
class BudgetStats:
    """Counters of the scheduler side (exported as metrics)."""

    requests_waited_for_rows: int = 0
    """Requests held back at least one step because their rows would not fit."""
    waiting_for_rows: int = 0
    """Requests held back at the last step."""


STATS = BudgetStats()
"""This engine-core process's counters."""


class RowBudget:
    """The rows the scheduled, not yet freed requests of one engine core take."""

    def __init__(self, max_rows: int, max_gates: int) -> None:
        self.max_rows, self.max_gates = max_rows, max_gates
        self._rows: Counter[str] = Counter()
        self._gates: Counter[str] = Counter()
        self._holding: dict[str, Claims] = {}
        self._waited: set[str] = set()

    def plan(self, waiting: Iterable[tuple[str, Claims | None]], slots: int) -> set[str]:
        """The waiting requests (in queue order) to hold back this step: those whose new rows
        would exceed the budget once the ones before them that fit took theirs. Stops after
        ``slots`` requests that may run (the most the scheduler can admit in one step), so
        while rows are free the work is per admitted request; only while requests are held
        back (rows exhausted) does it read further down the queue, a set difference each."""
        rows, gates = set(self._rows), set(self._gates)
        held: set[str] = set()
        for req_id, claims in waiting:
            if slots <= 0:
                break
            if claims is not None and req_id not in self._holding:
                new_rows, new_gates = claims.rows - rows, claims.gates - gates
                if (len(rows) + len(new_rows) > self.max_rows
                        or len(gates) + len(new_gates) > self.max_gates):
                    held.add(req_id)
                    continue
                rows |= new_rows
                gates |= new_gates
            slots -= 1
        STATS.requests_waited_for_rows += len(held - self._waited)
        STATS.waiting_for_rows = len(held)
        self._waited = held
        return held

    def take(self, req_id: str, claims: Claims | None) -> None:
        """A request was scheduled for the first time: it holds its rows until freed."""
        if claims is None or req_id in self._holding:
            return
        self._holding[req_id] = claims
        self._rows.update(claims.rows)
        self._gates.update(claims.gates)

    def release(self, req_id: str) -> None:
        """A request finished (or was aborted): its rows are free once no one else holds them."""
        claims = self._holding.pop(req_id, None)
        if claims is None:
            return
        self._rows.subtract(claims.rows)
        self._gates.subtract(claims.gates)
        self._rows = +self._rows
        self._gates = +self._gates

    @property
    def rows_held(self) -> int:
        return len(self._rows)


def stats() -> dict[str, int]:
    return dict(vars(STATS))
