"""Per-request gate statistics kept on the device: one fixed fold per step, small read-backs.

Folding a step's gates on the host (numpy over every gated token, then a read-back of the
step's gates) cost 100-250 µs per step at serving batch sizes, on the step path, where an
admission step's host time lands 1:1 on every running request's inter-token latency
(``benchmarks/RESULTS.md``, session 20). Here the counters live on the device, one column per
runner request slot, and a kernel folds each step into them after its forward (on CUDA a
replayed CUDA graph: no launch work on the host). The host reads back one ``[2, slots]``
array per step (each slot's first dynamically steered position and processed frontier: the
prefix guard's report), whole columns only when requests finish (one gather per step for all
of them) and everything only on a query.

``stats[STAT_COLS, slots]`` (int64; columns are slots, so the two read back each step are one
contiguous block), ``max_score[slots]`` (float32, -inf: none yet) and ``site_counts[sites, 2]``
(int64: tokens monitored and gated per monitor site). For every token ``t`` of the step with a
probe row (``index[INDEX_PROBE, t] != 0``), slot ``k = index[INDEX_SLOT, t]``, position
``p = index[INDEX_POS, t]``, gate ``g`` and score ``s``::

    site_counts[SITE[k]] += (1, g > GATE_ON)
    if p >= FRONTIER[k]:                     (not counted before: a preempted request's
        MONITORED[k] += 1                     recomputed positions count once)
        GATED_PREFILL[k] += g > GATE_ON and p < PROMPT_LEN[k]
        GATED_DECODE[k]  += g > GATE_ON and p >= PROMPT_LEN[k]
        FIRST_DECODE_GATED[k] = min(., p)     where g > GATE_ON and p >= PROMPT_LEN[k]
    max_score[k] = fmax(., s)                (NaN scores are ignored)
    FIRST_DYNAMIC[k] = min(., p)             where g > DYNAMIC_EPSILON and p >= DYNAMIC_FROM[k]
    UPTO[k] = max(., p + 1)

and then ``FRONTIER = UPTO``. :func:`fold_numpy` is that, in numpy (the CPU implementation and
the reference of the Triton kernel, :func:`.triton_kernels.stats_fold_triton`). Every update is
order-free (sums, minima, maxima), so the kernel uses atomics.

A slot's column is written when a request is admitted to it (fresh, or a resumed request's
saved counters) and read out when it finishes; both are queued on the host and applied in
:meth:`GateStats.apply`, once per step before the index is filled: read-outs first, so a slot
the runner gives to a new request at once still yields its old request's counters. The
stream orders every write, fold and read, so nothing waits for the GPU on the step path.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from ..prefix_guard.guard import DYNAMIC_EPSILON, NONE
from .ops import GATE, INDEX_POS, INDEX_PROBE, INDEX_SLOT, SCORE

GATE_ON = 0.5
"""A token counts as gated when its gate is above this."""

(FIRST_DYNAMIC, UPTO, MONITORED, GATED_PREFILL, GATED_DECODE, FIRST_DECODE_GATED, FRONTIER,
 PROMPT_LEN, DYNAMIC_FROM, SITE) = range(10)
STAT_COLS = 10
"""Rows of ``stats`` (one value per slot each): the first two are the per-step read-back."""
COUNTERS = (MONITORED, GATED_PREFILL, GATED_DECODE, FIRST_DECODE_GATED, FIRST_DYNAMIC, UPTO)
"""What a request's summary reads (and a resumed request gets back)."""
RING = 4
"""Per-step read-backs in flight; a fifth waits for the oldest."""
TURNS = 2
"""Staging buffers of admission writes and finish read-outs (the copy that last used one has
long finished when it comes round again)."""


def fresh_column(prompt_len: int, dynamic_from: int, site: int) -> np.ndarray:
    """A new request's column."""
    column = np.zeros(STAT_COLS, dtype=np.int64)
    column[[FIRST_DYNAMIC, FIRST_DECODE_GATED]] = NONE
    column[PROMPT_LEN], column[DYNAMIC_FROM], column[SITE] = prompt_len, dynamic_from, site
    return column


def fold_numpy(index: np.ndarray, gate_score: np.ndarray, stats: np.ndarray,
               max_score: np.ndarray, site_counts: np.ndarray) -> None:
    """Fold one step (every column of ``index`` with a probe row) in place (module
    docstring)."""
    t = np.flatnonzero(index[INDEX_PROBE])
    t = t[index[INDEX_SLOT, t] < stats.shape[1]]  # a slot past the table is not counted
    if t.size:
        k = index[INDEX_SLOT, t].astype(np.int64)
        p = index[INDEX_POS, t].astype(np.int64)
        g, s = gate_score[GATE, t], gate_score[SCORE, t]
        on = g > GATE_ON
        site = stats[SITE, k]
        np.add.at(site_counts[:, 0], site, 1)
        np.add.at(site_counts[:, 1], site[on], 1)
        new = p >= stats[FRONTIER, k]
        prompt = p < stats[PROMPT_LEN, k]
        np.add.at(stats[MONITORED], k[new], 1)
        np.add.at(stats[GATED_PREFILL], k[new & on & prompt], 1)
        decode_on = new & on & ~prompt
        np.add.at(stats[GATED_DECODE], k[decode_on], 1)
        np.minimum.at(stats[FIRST_DECODE_GATED], k[decode_on], p[decode_on])
        np.fmax.at(max_score, k, s)
        hot = (g > DYNAMIC_EPSILON) & (p >= stats[DYNAMIC_FROM, k])
        np.minimum.at(stats[FIRST_DYNAMIC], k[hot], p[hot])
        np.maximum.at(stats[UPTO], k, p + 1)
    stats[FRONTIER] = stats[UPTO]


class GateStats:
    """Owns the device statistics, folds steps into them and reads them back."""

    def __init__(self, index: torch.Tensor, gate_score: torch.Tensor, sites: int,
                 slots: int) -> None:
        device = index.device
        self._index, self._gate_score = index, gate_score
        self.stats = torch.zeros(STAT_COLS, slots, dtype=torch.int64, device=device)
        self.max_score = torch.full((slots,), -np.inf, dtype=torch.float32, device=device)
        self.site_counts = torch.zeros(sites, 2, dtype=torch.int64, device=device)
        self.folds = 0
        """Folds queued so far."""
        self._writes: dict[int, tuple[np.ndarray, float]] = {}
        """Slot -> (column, max score) to write."""
        self._reads: list[tuple[int, Any]] = []
        """(slot, owner) of finished requests whose columns are to be read out."""
        self._landed: list[tuple[Any, np.ndarray, float]] = []
        self._written_at = np.zeros(slots, dtype=np.int64)
        """Folds queued before each slot's last write (older snapshots predate it)."""
        self._snapshot = np.zeros((2, slots), dtype=np.int64)
        self._snapshot_folds = 0
        """Folds the snapshot includes."""
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._snap_ring = [torch.zeros(2, slots, dtype=torch.int64).pin_memory()
                               for _ in range(RING)]
            self._in_flight: deque[tuple[int, int]] = deque()
            self._graphs = [self._capture(i) for i in range(RING)]
            self._events = [torch.cuda.Event() for _ in range(RING)]
            self._staging = [_Staging(slots, device) for _ in range(TURNS)]
            self._read_staging = [_Staging(slots, device) for _ in range(TURNS)]
            self._reading: deque[tuple[int, list[Any]]] = deque()
            self._turn = self._read_turn = 0

    # ---- per step ---------------------------------------------------------------------
    def fold(self, tokens: int) -> None:
        """Fold the step whose forward was queued last (before its index is refilled);
        ``tokens``: its token count (CUDA reads the whole index instead: columns past the
        step's are zero)."""
        self.folds += 1
        if not self._cuda:
            fold_numpy(self._index.numpy()[:, :tokens], self._gate_score.numpy()[:, :tokens],
                       self.stats.numpy(), self.max_score.numpy(), self.site_counts.numpy())
            self._snapshot, self._snapshot_folds = self.stats[:2].numpy().copy(), self.folds
            return
        if len(self._in_flight) == RING:
            self._land(wait=True, limit=1)
        ring = self.folds % RING
        self._graphs[ring].replay()
        self._events[ring].record()
        self._in_flight.append((self.folds, ring))

    def frontiers(self) -> tuple[np.ndarray, np.ndarray]:
        """(processed frontier, first dynamic position) of every slot as of the newest landed
        fold; 0 and NONE for slots written since (their request's folds have not landed)."""
        if self._cuda:
            self._land(wait=False)
        stale = self._written_at >= self._snapshot_folds
        return (np.where(stale, 0, self._snapshot[1]),
                np.where(stale, NONE, self._snapshot[0]))

    def write(self, slot: int, column: np.ndarray, max_score: float = -np.inf) -> None:
        """Set the slot's column and max score (applied by :meth:`apply`, after the read-outs
        asked for before)."""
        self._writes[slot] = (column, max_score)

    def read(self, slot: int, owner: Any) -> None:
        """Read the slot's column out (at :meth:`apply`); :meth:`take` yields it with
        ``owner`` once it has landed."""
        pending = self._writes.pop(slot, None)
        if pending is not None:  # no step ran since it was written: that is its column
            self._landed.append((owner, pending[0].copy(), pending[1]))
        else:
            self._reads.append((slot, owner))

    def lower_first_dynamic(self, slot: int, position: int) -> None:
        """``FIRST_DYNAMIC = min(., position)`` for the slot (a controller's switch)."""
        pending = self._writes.get(slot)
        if pending is not None:
            pending[0][FIRST_DYNAMIC] = min(int(pending[0][FIRST_DYNAMIC]), position)
        else:
            self.stats[FIRST_DYNAMIC, slot:slot + 1].clamp_(max=position)

    def apply(self) -> None:
        """Queue the pending read-outs, then the pending writes."""
        if self._reads:
            reads, self._reads = self._reads, []
            if self._cuda:
                self._queue_reads(reads)
            else:
                cols, maxes = self.stats.numpy(), self.max_score.numpy()
                self._landed += [(owner, cols[:, slot].copy(), float(maxes[slot]))
                                 for slot, owner in reads]
        if self._writes:
            writes, self._writes = self._writes, {}
            slots = np.fromiter(writes, dtype=np.int64, count=len(writes))
            columns = np.stack([column for column, _ in writes.values()], axis=1)
            maxes = np.array([m for _, m in writes.values()], dtype=np.float32)
            self._written_at[slots] = self.folds
            if self._cuda:
                self._queue_writes(slots, columns, maxes)
            else:
                self.stats.numpy()[:, slots] = columns
                self.max_score.numpy()[slots] = maxes

    def take(self, wait: bool = False) -> list[tuple[Any, np.ndarray, float]]:
        """Finished requests' read-outs that landed (``wait``: all queued): (owner, column,
        max score)."""
        if self._cuda:
            self._land_reads(wait)
        landed, self._landed = self._landed, []
        return landed

    # ---- queries (may wait) -----------------------------------------------------------
    def column(self, slot: int) -> tuple[np.ndarray, float]:
        """A live slot's column and max score now (applies what is pending; waits)."""
        self.apply()
        return self.stats[:, slot].cpu().numpy(), float(self.max_score[slot].cpu())

    def site_totals(self) -> np.ndarray:
        """``site_counts`` now (waits)."""
        return self.site_counts.cpu().numpy()

    # ---- CUDA internals ---------------------------------------------------------------
    def _capture(self, ring: int) -> torch.cuda.CUDAGraph:
        """The fold and its read-back into ring buffer ``ring`` as a CUDA graph (compiled
        first, outside the capture; the index is all zeros here, so running it changes
        nothing)."""
        from .triton_kernels import stats_fold_triton

        def fold() -> None:
            stats_fold_triton(self._index, self._gate_score, self.stats, self.max_score,
                              self.site_counts)
            self._snap_ring[ring].copy_(self.stats[:2], non_blocking=True)

        fold()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fold()
        return graph

    def _land(self, wait: bool, limit: int | None = None) -> None:
        """Take the newest landed read-back (``wait``: wait for ``limit`` of them)."""
        done = 0
        while self._in_flight and (limit is None or done < limit):
            folds, ring = self._in_flight[0]
            event = self._events[ring]
            if not wait and not event.query():
                break
            event.synchronize()
            self._in_flight.popleft()
            done += 1
            if not self._in_flight or not self._events[self._in_flight[0][1]].query():
                self._snapshot = self._snap_ring[ring].numpy().copy()
                self._snapshot_folds = folds

    def _queue_writes(self, slots: np.ndarray, columns: np.ndarray, maxes: np.ndarray) -> None:
        staging = self._staging[self._turn]
        self._turn = (self._turn + 1) % TURNS
        device_slots, device_columns, device_maxes = staging.upload(slots, columns, maxes)
        self.stats.index_copy_(1, device_slots, device_columns)
        self.max_score.index_copy_(0, device_slots, device_maxes)
        staging.done.record()

    def _queue_reads(self, reads: list[tuple[int, Any]]) -> None:
        if len(self._reading) == TURNS:
            self._land_reads(wait=True, limit=1)
        turn = self._read_turn
        self._read_turn = (turn + 1) % TURNS
        staging = self._read_staging[turn]
        slots = np.fromiter((slot for slot, _ in reads), dtype=np.int64, count=len(reads))
        device_slots, _, _ = staging.upload(slots)
        staging.download(self.stats.index_select(1, device_slots),
                         self.max_score.index_select(0, device_slots))
        self._reading.append((turn, [owner for _, owner in reads]))

    def _land_reads(self, wait: bool, limit: int | None = None) -> None:
        done = 0
        while self._reading and (limit is None or done < limit):
            turn, owners = self._reading[0]
            staging = self._read_staging[turn]
            if not wait and not staging.done.query():
                return
            staging.done.synchronize()
            self._reading.popleft()
            cols, maxes = staging.downloaded(len(owners))
            self._landed += [(owner, cols[:, i].copy(), float(maxes[i]))
                             for i, owner in enumerate(owners)]
            done += 1

    def drain(self) -> None:
        """Apply what is pending and wait for every read-back."""
        self.apply()
        if self._cuda:
            self._land(wait=True)
            self._land_reads(wait=True)


class _Staging:
    """Pinned host and device buffers for one batch of column writes or read-outs."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.host_slots = torch.zeros(slots, dtype=torch.int64).pin_memory()
        self.host_cols = torch.zeros(STAT_COLS * slots, dtype=torch.int64).pin_memory()
        self.host_max = torch.zeros(slots, dtype=torch.float32).pin_memory()
        self.slots = torch.zeros(slots, dtype=torch.int64, device=device)
        self.cols = torch.zeros(STAT_COLS * slots, dtype=torch.int64, device=device)
        self.max = torch.zeros(slots, dtype=torch.float32, device=device)
        self.done = torch.cuda.Event()
        self.done.record()

    def upload(self, slots: np.ndarray, columns: np.ndarray | None = None,
               maxes: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """Copy ``slots`` (and ``columns``, ``[STAT_COLS, n]``, and ``maxes``) to the device;
        returns their device views."""
        n = len(slots)
        self.done.synchronize()  # this staging's previous copies have landed
        self.host_slots.numpy()[:n] = slots
        self.slots[:n].copy_(self.host_slots[:n], non_blocking=True)
        if columns is not None and maxes is not None:
            self.host_cols.numpy()[: STAT_COLS * n] = columns.reshape(-1)
            self.cols[: STAT_COLS * n].copy_(self.host_cols[: STAT_COLS * n], non_blocking=True)
            self.host_max.numpy()[:n] = maxes
            self.max[:n].copy_(self.host_max[:n], non_blocking=True)
        return self.slots[:n], self.cols[: STAT_COLS * n].view(STAT_COLS, n), self.max[:n]

    def download(self, cols: torch.Tensor, maxes: torch.Tensor) -> None:
        """Queue the copy of gathered columns ``[STAT_COLS, n]`` and max scores to the host."""
        n = cols.shape[1]
        self.host_cols[: STAT_COLS * n].view(STAT_COLS, n).copy_(cols, non_blocking=True)
        self.host_max[:n].copy_(maxes, non_blocking=True)
        self.done.record()

    def downloaded(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.host_cols.numpy()[: STAT_COLS * n].reshape(STAT_COLS, n),
                self.host_max.numpy()[:n])
