"""The per-token index: the steering, probe and capture row of each token of the step.

A persistent ``int32[INDEX_ROWS, max_tokens]`` buffer (rows ``INDEX_ROW``: steering rows,
``INDEX_PROBE``: probe rows, ``INDEX_CAPTURE``: capture rows, ``INDEX_CONTROL``: controller
rows; see :mod:`.ops`) the ops take whole and read the first ``T`` columns of, ``T`` the
step's token count. 0 means "none" in all four, so a cleared index and padding are inert. In
steps with gated tokens the rows ``INDEX_SLOT`` and ``INDEX_POS`` hold each token's request
slot and position (relative, so they stay the same from one decode step to the next), for the
gate statistics' fold (:mod:`.gate_stats`).

It is filled once per step, before the forward, from per-request values (a steering row for
prompt positions, one for generated positions, one probe row, the first capture row and the
number of capture rows) with vectorized numpy: no per-token or per-request Python on the hot
path. Tokens past the step's count (CUDA-graph padding) are kept at 0. On CUDA the fill is one
non-blocking copy from a pinned staging buffer, skipped entirely when nothing changed since the
previous step (the common decode case) or nothing is steered.

On arrays this small a numpy call's cost is its overhead, and some calls carry several times
more than others (``x.any()`` more than ``np.count_nonzero(x)``, ``np.array_equal`` far more
than comparing ``tobytes()``; inside a serving engine every call costs more than alone). The
step path uses the cheap forms, and skips ``np.repeat`` when every request has one token (a
decode step).

Where the model runner keeps the step's batch on the device (vLLM's V2 runner on CUDA) and the
step needs nothing per token on the host (no capture, no controller, no gate traces), the
index is filled there instead (:class:`DeviceFill`): a table of per-slot values
(:class:`SlotTable`, uploaded only when one changed) and one kernel, replayed from a CUDA
graph, that maps each token to its request's slot. A step that admits requests, where the
engine core's host time sets everyone's inter-token latency, then costs the host a copy and a
replay instead of the numpy fill.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .layout import (
    INDEX_CAPTURE,
    INDEX_CONTROL,
    INDEX_POS,
    INDEX_PROBE,
    INDEX_ROW,
    INDEX_ROWS,
    INDEX_SLOT,
    SLOT_DECODE,
    SLOT_PREFILL,
    SLOT_PROBE,
    SLOT_PROMPT_LEN,
    SLOT_ROWS,
)
from .step_upload import Layout, Staged, StepUpload


def expand_positions(num_computed: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray:
    """Absolute position of every token of the step (requests in batch order)."""
    starts = np.cumsum(num_scheduled) - num_scheduled
    return np.arange(int(num_scheduled.sum())) + np.repeat(num_computed - starts, num_scheduled)


def per_token(values: np.ndarray, counts: np.ndarray, one_each: bool) -> np.ndarray:
    """``values`` (per request) repeated for each of the request's ``counts`` tokens;
    ``one_each``: every count is 1, so that is ``values`` itself (not copied)."""
    return values if one_each else np.repeat(values, counts)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same values (same dtype and shape assumed; a differing
    one reads as different): ``np.array_equal`` at a tenth of its overhead."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _stretch_rows(rows: np.ndarray, positions: np.ndarray, counts: np.ndarray,
                  by_position: np.ndarray, starts: np.ndarray, stretch_rows: np.ndarray
                  ) -> np.ndarray:
    """``rows`` with the tokens of requests that steer by position given the row of their
    stretch (see :meth:`TokenRows.fill`)."""
    request = np.repeat(np.arange(len(counts)), counts)
    mine = np.flatnonzero(by_position[request])
    owner = request[mine]
    stretch = np.count_nonzero(starts[owner] <= positions[mine, None], axis=1) - 1
    rows = rows.copy()
    rows[mine] = stretch_rows[owner, stretch]
    return rows


def fill_layout(max_slots: int, batch: int) -> Layout:
    """The device fill's regions of a :class:`.StepUpload`: the batch's slots (changed with
    every admission or finish) and the slot table (with a steered one's)."""
    return {"batch_slots": ((batch,), np.int32), "slot_table": ((SLOT_ROWS, max_slots), np.int32)}


class SlotTable:
    """The per-slot values of the device fill, kept in step with the host's (uploaded only in
    steps where one changed: an admission, a finish, a controller's switch). Its device
    tensor never moves (a captured fill reads it)."""

    def __init__(self, upload: StepUpload) -> None:
        self.device = upload.region("slot_table")
        self._host = upload.host("slot_table")
        self._upload = upload
        self._slots = self._host.shape[1]
        self._version: object = None

    def fits(self, slots: int) -> bool:
        return slots <= self._slots

    def sync(self, version: object, entries: np.ndarray, prefill_rows: np.ndarray,
             decode_rows: np.ndarray, probe_rows: np.ndarray, prompt_lens: np.ndarray) -> None:
        """Every slot's values (rows are mapped to their ``INDEX_ROW`` entries here; the
        arrays are as long as the table: see :meth:`fits`), written whole for the next
        upload. ``version`` changes whenever any of them does: with the last one's, nothing
        is read."""
        if version == self._version:
            return
        self._version = version
        table, n = self._host, len(prefill_rows)
        np.take(entries, prefill_rows, out=table[SLOT_PREFILL, :n])
        np.take(entries, decode_rows, out=table[SLOT_DECODE, :n])
        table[SLOT_PROBE, :n] = probe_rows
        table[SLOT_PROMPT_LEN, :n] = prompt_lens
        self._upload.changed("slot_table")


class DeviceFill:
    """The index filled on the device from the slot table and the model runner's persistent
    device buffers of the step's batch (``query_start_loc`` and ``positions``, rewritten by
    the runner each step at the same address): one kernel over the largest batch, captured
    once in a CUDA graph. Per step the host replays the graph, after the batch's slots (from
    the host's array) and the slot table went to the device with the step's other uploads
    when they changed (:class:`.StepUpload`: one copy): at most two launches, whatever the
    batch (a Triton launch from Python costs several times a graph replay's host time). Two
    graphs: position entries absolute, or relative to where each request's
    previous step ended (a step where every request continues from there; then a decode
    step's index is the step before's).

    ``upload``: the step's shared uploads, with :func:`fill_layout`'s regions for at least
    the largest batch (None: uploads of its own)."""

    def __init__(self, rows: TokenRows, max_slots: int, query_start_loc: torch.Tensor,
                 positions: torch.Tensor, upload: StepUpload | None = None) -> None:
        from .kernels._tl import captured
        from .kernels.index_fill import index_fill_triton

        batch = query_start_loc.shape[0] - 1
        if upload is None:
            upload = StepUpload(fill_layout(max_slots, batch), query_start_loc.device)
        if upload.host("batch_slots").shape[0] < batch:
            raise ValueError(f"dynsteer device fill: the runner's batch holds {batch} requests, "
                             f"more than the {upload.host('batch_slots').shape[0]} slots it "
                             "was sized for")
        self._upload = upload
        self.table = SlotTable(upload)
        self._batch = upload.host("batch_slots")
        self._launch = functools.partial(index_fill_triton, rows.buffer, self.table.device,
                                         upload.region("batch_slots")[:batch],
                                         query_start_loc, positions)
        self._graphs = ({relative: captured(functools.partial(self._launch, relative=relative))
                         for relative in (False, True)}
                        if query_start_loc.is_cuda else None)
        self._last = b""
        """The slots last written (bytes of the host array)."""

    def run(self, slots: np.ndarray, relative: bool) -> None:
        """Fill the index of the step whose batch is in ``slots`` (one slot per request, in
        batch order), written for the upload only when they differ from the last step's (a
        decode step's batch usually does not change). ``relative``: every request continues
        where its previous step ended (position entries relative to there)."""
        key = slots.tobytes()
        if key != self._last:
            self._batch[: len(slots)] = slots
            self._upload.changed("batch_slots")
            self._last = key
        self._upload.send()
        if self._graphs is not None:
            self._graphs[relative].replay()
        else:  # CPU tensors: Triton's interpreter (tests)
            self._launch(relative=relative)


class TokenRows:
    """Owns the device index buffer the ops read and fills it each step."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.zeros(INDEX_ROWS, max_tokens, dtype=torch.int32, device=device)
        self.rows = self.buffer[INDEX_ROW]
        self.probe_rows = self.buffer[INDEX_PROBE]
        self.capture_rows = self.buffer[INDEX_CAPTURE]
        self._staged = Staged(self.buffer)  # whole-buffer staging: one DMA, no slicing
        self._staged_dirty = [0, 0]
        """Columns [0, d) of each staging buffer may be non-zero."""
        self._last: np.ndarray | None = np.zeros((INDEX_ROWS, 0), dtype=np.int32)
        """The index last published from the host (None: the device fill wrote since)."""
        self._dirty = 0
        """Columns [0, dirty) of the device buffer may be non-zero."""
        self._steady: object = None
        """The key of the steady step the device fill wrote the index for last (see
        :meth:`fill_from_slots`); None once anything else wrote it."""

    def clear(self) -> None:
        """Map every token to row 0 (touches the device only if something was set)."""
        if self._dirty:
            self._publish(np.zeros((INDEX_ROWS, 0), dtype=np.int32))

    def fill(
        self,
        prefill_rows: np.ndarray,
        decode_rows: np.ndarray,
        probe_rows: np.ndarray,
        prompt_lens: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        capture: tuple[np.ndarray, np.ndarray] | None = None,
        positions: np.ndarray | None = None,
        control_rows: np.ndarray | None = None,
        slots: np.ndarray | None = None,
        pos_entries: np.ndarray | None = None,
        tokens: int | None = None,
        stretches: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Set this step's tokens; arrays are per request, in batch order (``positions``, per
        token, may be passed by a caller that computed them already).

        A token at position ``p`` uses ``prefill_rows`` when ``p < prompt_len`` and
        ``decode_rows`` otherwise; every token of a request uses its ``probe_rows`` value.
        ``capture``: per request, its first capture row ``c`` (0: not captured) and its rows
        ``n``; its token at position ``p < n`` is captured into row ``c + p`` (None: nothing
        is captured). Every
        token of a request uses its ``control_rows`` value (None: no controller). With
        ``slots`` (the requests' slots, given when a probe row is set) the slot row is set
        too, and the position row to ``pos_entries`` (per token, see ``layout.POS_ABSOLUTE``).
        ``tokens``: the sum of ``num_scheduled``, where the caller has it already.
        ``stretches``: per request, whether it steers by position, and its stretches' first
        positions and rows (``[requests, MAX_STRETCHES]``, :mod:`.position_rows`): such a
        request's token at position ``p`` uses the row of the last stretch starting at or
        before ``p`` instead of its phase's (None: no request steers by position).
        """
        counts = num_scheduled.astype(np.int64, copy=False)
        tokens = int(counts.sum()) if tokens is None else tokens
        one_each = tokens == len(counts)
        capturing = capture is not None and np.count_nonzero(capture[0]) > 0
        by_phase = not same(prefill_rows, decode_rows)
        if positions is None and (capturing or by_phase or stretches is not None):
            positions = expand_positions(num_computed, counts)
        if by_phase:
            in_prompt = positions < per_token(prompt_lens, counts, one_each)
            rows = np.where(in_prompt, per_token(prefill_rows, counts, one_each),
                            per_token(decode_rows, counts, one_each))
        else:
            rows = per_token(prefill_rows, counts, one_each)
        if stretches is not None:
            rows = _stretch_rows(rows, positions, counts, *stretches)
        index = np.zeros((INDEX_ROWS, tokens), dtype=np.int32)
        index[INDEX_ROW] = rows
        index[INDEX_PROBE] = per_token(probe_rows, counts, one_each)
        if control_rows is not None:
            index[INDEX_CONTROL] = per_token(control_rows, counts, one_each)
        if slots is not None:
            index[INDEX_SLOT] = per_token(slots, counts, one_each)
            index[INDEX_POS] = pos_entries
        if capturing:
            starts = per_token(capture[0], counts, one_each)
            rows_of = per_token(capture[1], counts, one_each)
            index[INDEX_CAPTURE] = np.where((starts != 0) & (positions < rows_of),
                                            starts + positions, 0)
        if not np.count_nonzero(index):
            self.clear()
        elif self._last is None or not same(index, self._last):
            self._publish(index)

    def fill_from_slots(self, fill: DeviceFill, slots: np.ndarray, tokens: int,
                        steady: object = None) -> bool:
        """Set this step's ``tokens`` on the device (see :class:`DeviceFill`): no per-token or
        per-request work on the host, and no upload. The index is the one :meth:`fill` makes
        with the same values and no capture or controller rows, except that positions are
        absolute (``POS_ABSOLUTE``) and the slot and position rows are set for every token
        (the gate statistics read them only for tokens with a probe row).

        ``steady``: given (not None) for a step whose every token is the one decode token of a
        request that continues where its previous step ended; with positions relative to
        there, the index of such a step depends on its batch and the slot table only, so a
        key of those (see :meth:`.StepIndex.fill`). When the index was last written by a
        device fill with the same key, it already holds this step's: nothing is launched,
        and False is returned (True: filled)."""
        if steady is not None and steady == self._steady:
            return False
        fill.run(slots, relative=steady is not None)
        self._dirty = tokens
        self._last = None
        self._steady = steady
        return True

    def holds(self, steady: object) -> bool:
        """Whether the index is the one the device fill last wrote for key ``steady`` (see
        :meth:`fill_from_slots`): nothing cleared or rewrote it since."""
        return self._steady is not None and steady == self._steady

    def _publish(self, index: np.ndarray) -> None:
        """The buffer's first columns become ``index``, the rest zeros. On CUDA the whole
        buffer is copied from a pinned staging buffer that holds the same (one contiguous
        DMA of a few hundred kB, only in steps whose index changed: the first columns alone
        are strided, and a strided copy from the host goes through pageable memory and
        waits; slicing costs host time)."""
        n = index.shape[1]
        turn = self._staged.turn
        host = self._staged.stage()
        host[:, :n] = index
        host[:, n:max(self._staged_dirty[turn], self._dirty)] = 0
        self._staged_dirty[turn] = n
        self._staged.send()
        self._last = index.copy()
        self._dirty = n
        self._steady = None
