"""Per-slot rows: which steering row, probe row and controller row each live request uses.

Requests are tracked by *slot*: a small integer the runner adapter chooses (the V2 runner's own
request slot, or one the V1 adapter allocates). Per-slot numpy arrays make the per-step index
fill a vectorized gather (:mod:`.step_index`), and every rank assigns the same rows because it
sees the same admissions in the same order and derives the same row keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynsteer.controller.positions import END

from .global_steering import NO_GLOBAL, GlobalSteering
from .position_rows import MAX_STRETCHES, Stretch
from .resolve import (
    PHASES,
    UNSTEERED,
    Resolved,
    add_contents,
    add_projections,
    static_only,
)
from .rows import ProbeTable, RowTable

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])


@dataclass
class Admitted:
    """A live request as the worker holds it."""

    slot: int
    resolved: Resolved
    """What its spec builds: its own static, gated and projection entries (global steering
    excluded) and its probe."""
    wire: dict[str, Any] | None = None
    """The resolved spec (None: unsteered)."""
    control_row: int = 0
    """Its controller row (0: no controller)."""
    key: str = "-"
    """What determines its rows besides global steering and the registry: the resolved spec's
    content hash ("-": no spec)."""
    global_key: str = NO_GLOBAL
    """The global steering it was admitted under (it keeps it to the end)."""
    generation: int = 0
    """The registry generation its named vectors and probes resolve in (part of its row
    keys)."""
    stretches: list[Stretch] | None = None
    """Where its entries name positions: what steers each stretch of its positions (None:
    its phases' rows, :attr:`resolved`)."""


class SlotTable:
    """The per-slot arrays the step's index gathers from, and the rows behind them."""

    def __init__(self, max_slots: int, rows: RowTable, probe_table: ProbeTable) -> None:
        self.rows = rows
        self.probe_table = probe_table
        self.prefill_row = np.zeros(max_slots, dtype=np.int32)
        self.decode_row = np.zeros(max_slots, dtype=np.int32)
        self.prompt_len = np.zeros(max_slots, dtype=np.int64)
        self.probe_row = np.zeros(max_slots, dtype=np.int32)
        self.control_row = np.zeros(max_slots, dtype=np.int32)
        self.next_pos = np.full(max_slots, -1, dtype=np.int64)
        """Where each slot's request's last step ended (-1: no step yet)."""
        self.stretch_start = np.full((max_slots, MAX_STRETCHES), END, dtype=np.int64)
        """Per slot whose request steers by position: each stretch's first position (unused
        ones: :data:`.position_rows.END`); see :mod:`.position_rows`."""
        self.stretch_row = np.zeros((max_slots, MAX_STRETCHES), dtype=np.int32)
        """Each stretch's steering row."""
        self.by_position = np.zeros(max_slots, dtype=bool)
        """Whether the slot's request steers by position (its tokens' rows are its
        stretches', not its phases')."""
        self.num_by_position = 0
        """Live requests that steer by position (while 0, steps never look at stretches)."""
        self.version = 0
        """Counts the changes of the per-slot rows and prompt lengths that the device fill's
        slot table must follow: a steered request's admission and release. An unsteered one
        changes nothing there (its slot's rows are zero since the last occupant's release, and
        with both rows zero its prompt length picks nothing), so unsteered admissions and
        finishes upload no table."""
        self.num_steered = 0
        """Live requests whose slot has a nonzero row."""

    def __len__(self) -> int:
        return len(self.prompt_len)

    def place(self, slot: int, prompt_len: int) -> None:
        """A request is admitted into ``slot`` (grown to fit): its prompt length, no step yet.
        The slot table follows only if it steers (:meth:`assign`)."""
        old = len(self)
        if slot >= old:
            size = max(slot + 1, 2 * old)
            for name in ("prefill_row", "decode_row", "prompt_len", "probe_row",
                         "control_row", "next_pos", "stretch_start", "stretch_row",
                         "by_position"):
                arr = getattr(self, name)
                grown = np.full((size, *arr.shape[1:]), END if name == "stretch_start" else 0,
                                dtype=arr.dtype)
                grown[:old] = arr
                setattr(self, name, grown)
            self.version += 1
        self.prompt_len[slot] = prompt_len
        self.next_pos[slot] = -1

    def steers(self, slot: int) -> bool:
        return bool(self.prefill_row[slot] or self.decode_row[slot] or self.probe_row[slot]
                    or self.by_position[slot])

    def assign(self, req: Admitted, glob: GlobalSteering) -> None:
        """Take the request's rows. Row keys name what determines the contents (spec key,
        phase, registry and global versions), so a request whose rows exist already takes
        them without building or hashing anything; all ranks derive the same keys. An
        unsteered request under no global steering keeps its slot's zero rows (its admission,
        on the host-bound admitting step, skips the keys).

        A request that cannot get its rows (all in use, too many projections) runs unsteered
        in that phase, and one whose gate cannot get a probe row runs without its gated tier,
        each with a warning: a step must never fail because of one request."""
        if req.key == "-" and req.global_key == NO_GLOBAL:
            return
        own, gated, projections = req.resolved.own, req.resolved.gated, req.resolved.projections
        key = f"{req.key}|r{req.generation}"
        if req.resolved.probe is not None:
            probe_row = self.probe_table.acquire(req.resolved.probe, key=key.encode())
            if probe_row is None:
                # Without a monitor the token's gate buffer holds another token's gate: the
                # gated tier must not be read at all.
                logger.warning("dynsteer: all probe rows are in use; a request runs without "
                               "its gate (raise dynsteer.max_gates)")
                gated, key = UNSTEERED.gated, key + "-nogate"
                projections = {p: static_only(projections[p]) for p in PHASES}
            self.probe_row[req.slot] = probe_row or 0
        gateless = key.endswith("-nogate")
        if req.stretches is not None:
            self.by_position[req.slot] = True
            self.num_by_position += 1
            for i, stretch in enumerate(req.stretches):
                res = stretch.resolved
                self.stretch_start[req.slot, i] = stretch.start
                self.stretch_row[req.slot, i] = self._row(
                    f"{stretch.key}|r{req.generation}{'-nogate' if gateless else ''}",
                    stretch.phase, glob, req.global_key, res.own,
                    UNSTEERED.gated if gateless else res.gated,
                    {p: static_only(res.projections[p]) for p in PHASES} if gateless
                    else res.projections)
        else:
            for phase, target in zip(PHASES, (self.prefill_row, self.decode_row),
                                     strict=True):
                target[req.slot] = self._row(key, phase, glob, req.global_key, own, gated,
                                             projections)
        if self.steers(req.slot):
            self.num_steered += 1
            self.version += 1

    def _row(self, key: str, phase: str, glob: GlobalSteering, global_key: str,
             own: dict[str, Any], gated: dict[str, Any], projections: dict[str, Any]) -> int:
        """The row of one phase of a spec (or of one stretch) under global steering; 0 (and a
        warning) where it cannot be had."""
        try:
            row = self.rows.acquire_keyed(
                f"{key}|{phase}|g{global_key}".encode(),
                lambda: (add_contents(glob.adds[phase], own[phase]), gated[phase],
                         add_projections(glob.projections[phase], projections[phase])))
        except ValueError as e:  # global + own projections past max_projections
            logger.warning("dynsteer: a request runs unsteered in %s: %s (raise "
                           "dynsteer.max_projections)", phase, e)
            return 0
        if row is None:
            logger.warning(
                "dynsteer: all %d steering rows are in use; a request runs unsteered in %s "
                "(raise dynsteer.max_rows)", self.rows.max_rows, phase
            )
            return 0
        return row

    def release(self, req: Admitted) -> None:
        """Give the request's steering and probe rows back (its slot reads zero rows)."""
        if self.steers(req.slot):
            self.num_steered -= 1
            self.version += 1
        for target in (self.prefill_row, self.decode_row):
            self.rows.release(int(target[req.slot]))
            target[req.slot] = 0
        if self.by_position[req.slot]:
            for row in self.stretch_row[req.slot]:
                self.rows.release(int(row))
            self.stretch_row[req.slot] = 0
            self.stretch_start[req.slot] = END
            self.by_position[req.slot] = False
            self.num_by_position -= 1
        self.probe_table.release(int(self.probe_row[req.slot]))
        self.probe_row[req.slot] = 0
