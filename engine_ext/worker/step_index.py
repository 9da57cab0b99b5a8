"""The per-step token index: which rows, probe, capture lane and controller row each token of a
step reads (:mod:`.token_rows` holds it and its device fill).

Three ways to fill it, cheapest first: *kept* (a decode step of the steady batch before: three
byte comparisons, nothing launched), *device* (the device gathers from the slot table, uploaded
only when a steered request came or went), and *host* (vectorized numpy, for steps with a token
that needs host work of its own: capture, a controller, gate traces, steering by position).
Whole-array work only:
the step's host cost does not grow with the number of requests beyond numpy's vectorized
passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .capture_buffers import CaptureBuffers
from .control import ControlTable
from .controllers import ControllerRunner
from .layout import POS_ABSOLUTE
from .rows import RowTable
from .slots import SlotTable
from .step_upload import StepUpload
from .telemetry import GateTelemetry
from .token_rows import DeviceFill, TokenRows, per_token


@dataclass
class _Kept:
    """The decode batch whose index the device fill holds (see :meth:`StepIndex._keeps`): the
    bytes a next step of it carries (its slots and the slot table's version are checked
    against the key the index holds, :meth:`.TokenRows.holds`)."""

    ones: bytes
    """``num_scheduled`` of a step of one decode token per request."""
    end: bytes
    """``num_computed`` of a step continuing where this one ended."""
    any_gated: bool


class StepIndex:
    """Fills the token index of each step from the slot table."""

    def __init__(self, slots: SlotTable, rows: RowTable, token_rows: TokenRows,
                 telemetry: GateTelemetry, control: ControlTable,
                 controllers: ControllerRunner, capture: CaptureBuffers,
                 uploads: StepUpload) -> None:
        self.slots = slots
        self.rows = rows
        self.token_rows = token_rows
        self.telemetry = telemetry
        self.control = control
        self.controllers = controllers
        self.capture = capture
        self.uploads = uploads
        self.device_fill: DeviceFill | None = None
        """The index filled on the device, where the runner keeps its batch there (see
        :meth:`enable_device_fill`)."""
        self.fills = {"device": 0, "host": 0, "kept": 0}
        """Steps whose index the device filled, those the host filled, and those whose index
        the device path kept from the step before (the same decode batch, each request
        continuing where its last step ended)."""
        self._kept: _Kept | None = None
        """The steady decode batch the index holds, while no request was admitted or removed
        since."""

    def forget_batch(self) -> None:
        """A request was admitted or removed (or token hand-overs began): the next step takes
        a full path."""
        self._kept = None

    def enable_device_fill(self, query_start_loc: torch.Tensor, positions: torch.Tensor
                           ) -> None:
        """Let the device fill the index from the runner's persistent buffers of each step's
        batch (see :class:`.token_rows.DeviceFill`); steps then pass their batch's slots as a
        device tensor to :meth:`fill`."""
        self.device_fill = DeviceFill(self.token_rows, len(self.slots), query_start_loc,
                                      positions, self.uploads)

    def fill(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray,
             device_slots: torch.Tensor | None = None) -> None:
        """Fill the token index for one step; arrays are per request in batch order.

        ``device_slots``: ``slots`` on the device, given where the runner has them and its
        persistent buffers hold the step's batch (see :meth:`enable_device_fill`); then,
        unless a token needs host work of its own (capture, a controller, gate traces), the
        device fills the index. It reads the host's ``slots``, sent with the step's other
        uploads in one copy (:mod:`.step_upload`), not this tensor, which vLLM allocates
        anew each step.

        Order matters: the previous step's copies are launched first (the controller table
        as it was during that step), then Python controllers act (they may switch rows), the
        step is registered, the built-in controllers fold the previous step (on the stream,
        before the index is refilled) and last the index is filled."""
        self.telemetry.launch_copy()
        self.controllers.before_step(self.telemetry.steps)
        if device_slots is not None and self._keeps(slots, num_computed, num_scheduled):
            return
        table = self.slots
        probe_rows = table.probe_row[slots]
        gated = probe_rows != 0
        any_gated = np.count_nonzero(gated) > 0  # the cheap forms: see token_rows' docstring
        counts = num_scheduled.astype(np.int64, copy=False)
        capture = self.capture.slot_starts(slots)
        control_rows = table.control_row[slots]
        controlled = np.count_nonzero(control_rows) > 0
        by_position = table.by_position[slots] if table.num_by_position else None
        stretched = by_position is not None and np.count_nonzero(by_position) > 0
        tokens = int(counts.sum())
        if (device_slots is not None and self.device_fill is not None
                and capture is None and not controlled and not self.telemetry.wants_tokens
                and not stretched and self.device_fill.table.fits(len(table))):
            filled = self._fill_on_device(slots, num_computed, num_scheduled, tokens,
                                          any_gated)
            self.fills["device" if filled else "kept"] += 1
            return
        self.fills["host"] += 1
        positions = pos_entries = None
        if any_gated:
            positions, pos_entries = self._gate_positions(slots, gated, num_computed, counts,
                                                          tokens, controlled)
        if positions is not None and (controlled or self.telemetry.wants_tokens):
            request = np.repeat(np.arange(len(counts)), counts)
            mine = gated[request]
            self.telemetry.before_step(
                tokens, True, np.flatnonzero(mine), np.asarray(slots)[request[mine]],
                positions[mine], np.repeat(control_rows, counts)[mine] if controlled else None)
        else:
            self.telemetry.before_step(tokens, any_gated)
        self.control.before_step(tokens)
        entries = self.rows.entries
        self.token_rows.fill(
            entries[table.prefill_row[slots]],
            entries[table.decode_row[slots]],
            probe_rows,
            table.prompt_len[slots],
            num_computed,
            counts,
            capture,
            positions,
            control_rows,
            slots if any_gated else None,
            pos_entries,
            tokens,
            (by_position, table.stretch_start[slots], entries[table.stretch_row[slots]])
            if stretched else None,
        )
        if capture is not None:
            self.capture.record(slots, capture[0], num_computed, num_scheduled)

    def skip(self) -> None:
        """A step with nothing steered, or a forward no request is in (a data-parallel idle
        batch): fold the previous step (telemetry, controllers: against the index it ran
        with), then clear the index, so no token of this forward reads a request's rows,
        capture slots or controller rows."""
        self.telemetry.before_step(0, False)
        self.controllers.before_step(self.telemetry.steps)
        self.control.before_step(0)
        self.token_rows.clear()

    def _fill_on_device(self, slots: np.ndarray, num_computed: np.ndarray,
                        num_scheduled: np.ndarray, tokens: int, any_gated: bool) -> bool:
        """:meth:`fill` by the device, from the slot table (uploaded if a slot changed).
        False: the index already held the step's (a decode step of the batch before: see
        :meth:`.TokenRows.fill_from_slots`), nothing was launched."""
        assert self.device_fill is not None
        table = self.slots
        self.telemetry.before_step(tokens, any_gated)
        self.control.before_step(tokens)
        version = (table.version, self.rows.entries_version)
        self.device_fill.table.sync(version, self.rows.entries, table.prefill_row,
                                    table.decode_row, table.probe_row, table.prompt_len)
        steady = None  # one decode token each (rows: decode), each where its request ended
        if (tokens == len(slots)
                and not np.count_nonzero(num_computed < table.prompt_len[slots])
                and not np.count_nonzero(num_computed != table.next_pos[slots])):
            steady = (slots.tobytes(), version)
        table.next_pos[slots] = num_computed + num_scheduled  # where each request's step ends
        filled = self.token_rows.fill_from_slots(self.device_fill, slots, tokens, steady)
        self._kept = None if steady is None else _Kept(
            np.ones_like(num_scheduled).tobytes(), (num_computed + 1).tobytes(), any_gated)
        return filled

    def _keeps(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
               ) -> bool:
        """:meth:`fill`'s path for a decode step of the steady batch before (most steps of a
        serving engine): the same slots in the same order, one token each, each continuing
        where its last step ended, no request admitted or removed since (:attr:`_kept`), the
        slot table's version unchanged and the index still the one the device filled for it.
        Then nothing that :meth:`fill` reads can differ from that step's (capture, controller
        rows and token hand-overs change only with admissions, removals and event
        publishing), so the index is kept after three byte comparisons, without
        :meth:`_fill_on_device`'s per-slot look-ups. False: take the full path."""
        kept = self._kept
        if (kept is None or num_scheduled.tobytes() != kept.ones
                or num_computed.tobytes() != kept.end
                or not self.token_rows.holds(
                    (slots.tobytes(), (self.slots.version, self.rows.entries_version)))):
            return False
        tokens = len(slots)
        self.telemetry.before_step(tokens, kept.any_gated)
        self.control.before_step(tokens)
        end = num_computed + 1
        self.slots.next_pos[slots] = end
        kept.end = end.tobytes()
        self.fills["kept"] += 1
        return True

    def _gate_positions(self, slots: np.ndarray, gated: np.ndarray, num_computed: np.ndarray,
                        counts: np.ndarray, tokens: int, controlled: bool
                        ) -> tuple[np.ndarray | None, np.ndarray]:
        """The token positions (None where nothing needs them this step) and the index's
        position entries of a gated step: each token's offset from where its request's
        previous step ended, so a decode step's entries repeat (no upload), and the position
        itself (``POS_ABSOLUTE``) for requests that did not continue where they ended (just
        admitted, resumed, recomputed, or rejected speculative tokens). ``tokens``: the
        step's token count (the sum of ``counts``)."""
        one_each = tokens == len(counts)  # a decode step: every offset is 0
        if one_each:
            offsets = np.zeros(tokens, dtype=np.int64)
        else:
            starts = np.cumsum(counts) - counts
            offsets = np.arange(tokens) - np.repeat(starts, counts)
        next_pos = self.slots.next_pos
        moved = gated & (num_computed != next_pos[slots])
        any_moved = np.count_nonzero(moved) > 0
        next_pos[slots] = num_computed + counts
        positions = None
        if any_moved or controlled or self.telemetry.wants_tokens:
            positions = offsets + per_token(num_computed, counts, one_each)
        if any_moved:
            jumps = per_token(moved, counts, one_each)
            offsets[jumps] = positions[jumps] | POS_ABSOLUTE
        return positions, offsets
