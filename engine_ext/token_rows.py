"""The per-token row index: which steering row each token of the step uses.

A persistent ``int32[max_tokens]`` buffer the ops slice with the step's token count. It is filled
once per step, before the forward, from per-request rows (one for prompt positions, one for
generated positions) with vectorized numpy: no per-token or per-request Python on the hot path.
Tokens past the step's count (CUDA-graph padding) are kept at row 0. On CUDA the fill goes
through a pinned staging buffer with one non-blocking copy, and is skipped entirely when the
rows did not change since the previous step (the common decode case) or nothing is steered.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenRows:
    """Owns the device buffer the ops read and fills it each step."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self._on_host = device.type == "cpu"
        if self._on_host:
            self._host = [self.buffer.numpy()]
        else:
            pinned = [torch.zeros(max_tokens, dtype=torch.int32).pin_memory() for _ in range(2)]
            self._pinned = pinned
            self._host = [p.numpy() for p in pinned]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self._last = np.zeros(0, dtype=np.int32)
        self._dirty = 0
        """Entries [0, dirty) of the device buffer may be non-zero."""

    def clear(self) -> None:
        """Map every token to row 0 (only touches the device if something was set)."""
        if self._dirty:
            self._publish(np.zeros(0, dtype=np.int32))

    def fill(
        self,
        prefill_rows: np.ndarray,
        decode_rows: np.ndarray,
        prompt_lens: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> None:
        """Set the rows of this step's tokens; arrays are per request, in batch order.

        A token at position ``p`` of a request uses ``prefill_rows`` when ``p < prompt_len``
        and ``decode_rows`` otherwise.
        """
        num_scheduled = num_scheduled.astype(np.int64, copy=False)
        if np.array_equal(prefill_rows, decode_rows):
            rows = np.repeat(prefill_rows, num_scheduled)
        else:
            total = int(num_scheduled.sum())
            starts = np.cumsum(num_scheduled) - num_scheduled
            positions = np.arange(total) + np.repeat(num_computed - starts, num_scheduled)
            in_prompt = positions < np.repeat(prompt_lens, num_scheduled)
            rows = np.where(
                in_prompt,
                np.repeat(prefill_rows, num_scheduled),
                np.repeat(decode_rows, num_scheduled),
            )
        if not rows.any():
            self.clear()
        elif not np.array_equal(rows, self._last):
            self._publish(rows.astype(np.int32, copy=False))

    def _publish(self, rows: np.ndarray) -> None:
        n = len(rows)
        span = max(n, self._dirty)
        host = self._host[self._turn]
        if not self._on_host:
            # The copy that last read this staging buffer must be done before it is rewritten.
            self._events[self._turn].synchronize()
        host[:n] = rows
        host[n:span] = 0
        if not self._on_host:
            self.buffer[:span].copy_(self._pinned[self._turn][:span], non_blocking=True)
            self._events[self._turn].record()
            self._turn ^= 1
        self._last = rows.copy()
        self._dirty = n
