"""The workers' side of the prefix guard: which gated requests' clean prefix grew.

A gated request's KV blocks may be shared only up to its first dynamically steered position
(:mod:`.guard`); the workers know that position (the gate statistics keep it, per request
slot, on the device) and tell the scheduler, after every step, each request whose clean prefix
grew by a whole block. This module turns the statistics' latest snapshot into that report with
whole-array operations, and knows when it has settled: once every live gated request's clean
prefix stopped growing (its first dynamic position reached and reported), nothing is reported
until the next admission, and the statistics need not copy a snapshot back at all.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .guard import NONE, grown_frontiers


class Frontiers(Protocol):
    """What the report reads of the gate statistics (:class:`...worker.gate_stats.GateStats`)."""

    @property
    def snapshot_folds(self) -> int: ...
    def frontiers(self) -> tuple[np.ndarray, np.ndarray]: ...
    def all_current(self) -> bool: ...
    def current(self, slots: np.ndarray) -> np.ndarray: ...


class CleanPrefixReport:
    """Per runner slot: the live gated request in it and the blocks of its clean prefix
    reported so far. ``block_size`` is the KV block size."""

    def __init__(self, max_slots: int, block_size: int) -> None:
        self._block = block_size
        self._req_of_slot = np.full(max_slots, None, dtype=object)
        """Live gated request id of each slot, or None (an object array, so a report picks
        its ids without a Python loop)."""
        self._live_slot = np.zeros(max_slots, dtype=bool)
        """``_req_of_slot``'s non-None entries as a mask, which the object array cannot give
        without a Python comparison per slot."""
        self._reported = np.zeros(max_slots, dtype=np.int64)
        """Blocks of each slot's clean prefix reported so far."""
        self._reported_snapshot = -1
        """The statistics snapshot the last report was made of."""
        self.settled = False
        """Every live gated request's clean prefix stopped growing: no report until the next
        admission."""

    def admit(self, slot: int, req_id: str) -> None:
        self._req_of_slot[slot], self._reported[slot] = req_id, 0
        self._live_slot[slot], self.settled = True, False

    def finish(self, slot: int, req_id: str) -> None:
        if self._req_of_slot[slot] == req_id:
            self._req_of_slot[slot] = None
            self._live_slot[slot] = False

    def report(self, stats: Frontiers, any_live: bool) -> dict[str, tuple[int, int | None]]:
        """Requests whose clean prefix grew by a whole block since the last report: (positions
        processed, first dynamically steered position or None). Empty after a few whole-array
        operations when no gated request is live (``any_live``), when no snapshot landed since
        the last report, when the report has settled, or when no frontier grew by a block
        (most steps: a decode step adds one position per request)."""
        snapshot = stats.snapshot_folds
        if not any_live or self.settled or snapshot == self._reported_snapshot:
            return {}
        self._reported_snapshot = snapshot
        upto, first_dynamic = stats.frontiers()
        grown, blocks = grown_frontiers(upto, first_dynamic, self._reported, self._block)
        if not grown.size:
            # Settled: processed past the first dynamic position (which only ever lowers),
            # every block below it reported, and the snapshot describes every slot.
            self.settled = stats.all_current() and not np.count_nonzero(
                self._live_slot & (first_dynamic > upto))
            return {}
        grown = grown[stats.current(grown)]  # not those admitted since the snapshot
        self._reported[grown] = blocks[grown]
        slots = grown[np.not_equal(self._req_of_slot[grown], None)]
        first = first_dynamic[slots]
        return dict(zip(self._req_of_slot[slots].tolist(),
                        zip(upto[slots].tolist(), np.where(first == NONE, None, first).tolist(),
                            strict=True), strict=True))
