"""The device table of per-request controller state (see :mod:`.ops`, ``control``).

Row ``slot + 1`` belongs to the request in runner slot ``slot`` while it has a controller
(row 0: none). A built-in controller's row is written once, when its request is admitted, and
from then on only by :func:`.ops.control_step`; a Python controller's row (kind 0) only by the
host, when an action changes its floor or scale. One owner per row, so the two never race.

Per step: :meth:`ControlTable.before_step` launches the fold of the previous step into the
built-in rows (queued on the stream: after that step's forward, before the next index fill and
forward; on CUDA one replay of a CUDA graph captured when the table is made, so its two Triton
kernels cost no launch work on the host), then the host's pending row writes (admissions,
actions): one copy, only on steps that have any. Nothing waits for the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cuda_events
from .layout import CTL_COLS, CTL_FLOOR, CTL_KIND, CTL_P0, CTL_SCALE
from .ops import control_step


class ControlTable:
    """Owns ``control[max_slots + 1, CTL_COLS]`` and the host's mirror of its host rows;
    folds steps read from the op's ``index`` and ``gate_score`` buffers."""

    def __init__(self, max_slots: int, index: torch.Tensor, gate_score: torch.Tensor) -> None:
        device = index.device
        self.table = torch.zeros(max_slots + 1, CTL_COLS, dtype=torch.float32, device=device)
        self._index, self._gate_score = index, gate_score
        self._graph = self._capture_fold() if device.type == "cuda" else None
        self._mirror = np.zeros((max_slots + 1, CTL_COLS), dtype=np.float32)
        """What the host last wrote to each row (exact for Python rows, initial for built-in)."""
        self._dirty: set[int] = set()
        if device.type == "cuda":  # staging of row writes, allocated once (see _write)
            rows = max_slots + 1
            self._pinned = [(torch.zeros(rows, CTL_COLS).pin_memory(),
                             torch.zeros(rows, dtype=torch.int64).pin_memory())
                            for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._staged = (torch.zeros(rows, CTL_COLS, device=device),
                            torch.zeros(rows, dtype=torch.int64, device=device))
            self._turn = 0
        self._builtin_live = 0
        self._last_tokens = 0
        """Token count of the step whose fold is due."""

    @property
    def rows(self) -> int:
        return self.table.shape[0] - 1

    def admit(self, slot: int, kind: int, floor: float, scale: float,
              params: tuple[float, float, float]) -> int:
        """Initialize the row of runner slot ``slot`` (written before the next forward);
        returns the row (0 when the slot has none: the request runs without its controller)."""
        row = slot + 1
        if row > self.rows:
            return 0
        values = self._mirror[row]
        values[:] = 0
        values[CTL_KIND], values[CTL_FLOOR], values[CTL_SCALE] = kind, floor, scale
        values[CTL_P0:CTL_P0 + 3] = params
        self._dirty.add(row)
        self._builtin_live += kind != 0
        return row

    def release(self, row: int) -> None:
        """The row's request left; the row is re-initialized before it is used again."""
        if row:
            self._builtin_live -= self._mirror[row, CTL_KIND] != 0

    def set(self, rows: np.ndarray, floor: np.ndarray | None = None,
            scale: np.ndarray | None = None) -> None:
        """Set the floor and/or scale of Python controllers' rows (applied before the next
        forward)."""
        if floor is not None:
            self._mirror[rows, CTL_FLOOR] = floor
        if scale is not None:
            self._mirror[rows, CTL_SCALE] = scale
        self._dirty.update(rows.tolist())

    def host_state(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the (floor, scale) the host last wrote to Python controllers' rows."""
        return self._mirror[rows, CTL_FLOOR].copy(), self._mirror[rows, CTL_SCALE].copy()

    def before_step(self, tokens: int) -> None:
        """Fold the previous step into built-in rows, then write pending rows; ``tokens`` is
        the step about to run (its fold is due next time)."""
        if self._builtin_live and self._last_tokens:
            if self._graph is not None:
                self._graph.replay()
            else:
                control_step(self._index, self._gate_score, self.table, self._last_tokens)
        self._last_tokens = tokens
        if self._dirty:
            self._write(np.fromiter(sorted(self._dirty), dtype=np.int64))
            self._dirty.clear()

    def _capture_fold(self) -> torch.cuda.CUDAGraph:
        """The CUDA fold as a graph (compiled first, outside the capture). Every row is 0
        (no controller) here, so running it changes nothing."""
        from .kernels._tl import captured
        from .kernels.control_fold import control_step_triton, new_fold_scratch

        self._scratch = new_fold_scratch(self.table)
        return captured(lambda: control_step_triton(self._index, self._gate_score, self.table,
                                                    self._scratch))

    def _write(self, rows: np.ndarray) -> None:
        """Copy the mirror's ``rows`` to the table. On CUDA through preallocated pinned and
        device staging (two pinned turns: the copy that last read one has long finished when
        it comes round again), so the copies queue behind the forward in flight instead of
        waiting for it, and a step that writes allocates nothing."""
        if self._graph is None:
            self.table[torch.from_numpy(rows)] = torch.from_numpy(self._mirror[rows])
            return
        n = len(rows)
        values, index = self._pinned[self._turn]
        self._events[self._turn].synchronize()
        values.numpy()[:n] = self._mirror[rows]
        index.numpy()[:n] = rows
        staged_values, staged_index = self._staged
        staged_values[:n].copy_(values[:n], non_blocking=True)
        staged_index[:n].copy_(index[:n], non_blocking=True)
        cuda_events.record(self._events[self._turn], self.table.device.index)
        self._turn ^= 1
        self.table.index_copy_(0, staged_index[:n], staged_values[:n])
