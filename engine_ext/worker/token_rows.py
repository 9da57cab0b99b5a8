"""The per-token index: the steering, probe and capture row of each token of the step.

A persistent ``int32[INDEX_ROWS, max_tokens]`` buffer (rows ``INDEX_ROW``: steering rows,
``INDEX_PROBE``: probe rows, ``INDEX_CAPTURE``: capture rows, ``INDEX_CONTROL``: controller
rows; see :mod:`.ops`) the ops take whole and read the first ``T`` columns of, ``T`` the
step's token count. 0 means "none" in all four, so a cleared index and padding are inert. In
steps with gated tokens the rows ``INDEX_SLOT`` and ``INDEX_POS`` hold each token's request
slot and position (relative, so they stay the same from one decode step to the next), for the
gate statistics' fold (:mod:`.gate_stats`).

It is filled once per step, before the forward, from per-request values (a steering row for
prompt positions, one for generated positions, one probe row, the first capture row of the
prompt) with vectorized numpy: no per-token or per-request Python on the hot path. Tokens past
the step's count (CUDA-graph padding) are kept at 0. On CUDA the fill is one non-blocking copy
from a pinned staging buffer, skipped entirely when nothing changed since the previous step
(the common decode case) or nothing is steered.
"""

from __future__ import annotations

import numpy as np
import torch

from .ops import (
    INDEX_CAPTURE,
    INDEX_CONTROL,
    INDEX_POS,
    INDEX_PROBE,
    INDEX_ROW,
    INDEX_ROWS,
    INDEX_SLOT,
)


def expand_positions(num_computed: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray:
    """Absolute position of every token of the step (requests in batch order)."""
    starts = np.cumsum(num_scheduled) - num_scheduled
    return np.arange(int(num_scheduled.sum())) + np.repeat(num_computed - starts, num_scheduled)


class TokenRows:
    """Owns the device index buffer the ops read and fills it each step."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.zeros(INDEX_ROWS, max_tokens, dtype=torch.int32, device=device)
        self.rows = self.buffer[INDEX_ROW]
        self.probe_rows = self.buffer[INDEX_PROBE]
        self.capture_rows = self.buffer[INDEX_CAPTURE]
        self._on_host = device.type == "cpu"
        if not self._on_host:  # whole-buffer staging: one contiguous DMA, no slicing
            shape = (INDEX_ROWS, max_tokens)
            self._pinned = [torch.zeros(shape, dtype=torch.int32).pin_memory() for _ in range(2)]
            self._host = [p.numpy() for p in self._pinned]
            self._host_dirty = [0, 0]
            """Columns [0, d) of each staging buffer may be non-zero."""
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self._last = np.zeros((INDEX_ROWS, 0), dtype=np.int32)
        self._dirty = 0
        """Columns [0, dirty) of the device buffer may be non-zero."""

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
        capture_starts: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        control_rows: np.ndarray | None = None,
        slots: np.ndarray | None = None,
        pos_entries: np.ndarray | None = None,
    ) -> None:
        """Set this step's tokens; arrays are per request, in batch order (``positions``, per
        token, may be passed by a caller that computed them already).

        A token at position ``p`` uses ``prefill_rows`` when ``p < prompt_len`` and
        ``decode_rows`` otherwise; every token of a request uses its ``probe_rows`` value.
        A prompt token of a request with a nonzero ``capture_starts`` value ``c`` is captured
        into row ``c + p``; generated tokens never are (None: nothing is captured). Every
        token of a request uses its ``control_rows`` value (None: no controller). With
        ``slots`` (the requests' slots, given when a probe row is set) the slot row is set
        too, and the position row to ``pos_entries`` (per token, see ``ops.POS_ABSOLUTE``).
        """
        num_scheduled = num_scheduled.astype(np.int64, copy=False)
        capturing = capture_starts is not None and bool(capture_starts.any())
        by_phase = not np.array_equal(prefill_rows, decode_rows)
        in_prompt = np.zeros(0, dtype=bool)
        if positions is None and (capturing or by_phase):
            positions = expand_positions(num_computed, num_scheduled)
        if capturing or by_phase:
            in_prompt = positions < np.repeat(prompt_lens, num_scheduled)
        if by_phase:
            rows = np.where(in_prompt, np.repeat(prefill_rows, num_scheduled),
                            np.repeat(decode_rows, num_scheduled))
        else:
            rows = np.repeat(prefill_rows, num_scheduled)
        index = np.zeros((INDEX_ROWS, len(rows)), dtype=np.int32)
        index[INDEX_ROW] = rows
        index[INDEX_PROBE] = np.repeat(probe_rows, num_scheduled)
        if control_rows is not None:
            index[INDEX_CONTROL] = np.repeat(control_rows, num_scheduled)
        if slots is not None:
            index[INDEX_SLOT] = np.repeat(slots, num_scheduled)
            index[INDEX_POS] = pos_entries
        if capturing:
            starts = np.repeat(capture_starts, num_scheduled)
            index[INDEX_CAPTURE] = np.where(in_prompt & (starts != 0), starts + positions, 0)
        if not index.any():
            self.clear()
        elif not np.array_equal(index, self._last):
            self._publish(index)

    def _publish(self, index: np.ndarray) -> None:
        """The buffer's first columns become ``index``, the rest zeros. On CUDA the whole
        buffer is copied from a pinned staging buffer that holds the same (one contiguous
        DMA of a few hundred kB, only in steps whose index changed: the first columns alone
        are strided, and a strided copy from the host goes through pageable memory and
        waits; slicing costs host time)."""
        n = index.shape[1]
        if self._on_host:
            self.buffer.numpy()[:, :n] = index
            self.buffer.numpy()[:, n:self._dirty] = 0
        else:
            turn = self._turn
            # The copy that last read this staging buffer must be done before it is rewritten.
            self._events[turn].synchronize()
            host = self._host[turn]
            host[:, :n] = index
            host[:, n:self._host_dirty[turn]] = 0
            self._host_dirty[turn] = n
            self.buffer.copy_(self._pinned[turn], non_blocking=True)
            self._events[turn].record()
            self._turn ^= 1
        self._last = index.copy()
        self._dirty = n
