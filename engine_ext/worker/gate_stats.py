"""Per-request gate statistics kept on the device: one CUDA-graph replay per step.

Folding a step's gates on the host (numpy over every gated token, then a read-back of the step's
gates) would cost 100-250 µs per step at serving batch sizes, on the step path, where an
admission step's host time lands 1:1 on every running request's inter-token latency. Here the
counters live on the device, one column per runner request slot, and one replayed CUDA graph per
step (no launch work on the host) does everything after the step's forward: it reads out the
columns of requests that finished, writes the columns of requests admitted, folds the step's
gates in, and copies back one ``[2, slots]`` array (each slot's first dynamically steered
position and processed frontier: all the prefix guard's report needs) and the read-outs. Per
step the host packs the step's admissions and finishes into an op buffer (sent with the step's
other uploads, only when there are any: :mod:`.step_upload`), replays the graph and records one
event; it never waits for the GPU. Once the prefix guard's report has settled (no live request's
clean prefix can grow until the next admission), a step that reads out and writes nothing
replays a graph that copies nothing back, with no event: the replay is its only CUDA call.

``stats[STAT_COLS, slots]`` (int64; columns are slots, so the two read back each step are one
contiguous block) and ``site_counts[sites, 2]`` (int64: tokens monitored and gated per monitor
site). ``MAX_SCORE`` holds :func:`score_key` of the largest score (ordered like the floats, so
a maximum of keys is the key of the maximum; :data:`NO_SCORE`: none yet). For every token
``t`` of the step with a probe row (``index[INDEX_PROBE, t] != 0``), slot
``k = index[INDEX_SLOT, t]`` (below ``slots``), gate ``g``, score ``s`` and position ``p``
(``e = index[INDEX_POS, t]``: ``e`` without the bit ``POS_ABSOLUTE`` where it is set, else
``START[k] + e``: the offset from where the slot's previous step ended, so a decode step's
index does not change and needs no upload)::

    site_counts[SITE[k]] += (1, g > GATE_ON)
    if p >= FRONTIER[k]:                     (not counted before: a preempted request's
        MONITORED[k] += 1                     recomputed positions count once)
        GATED_PREFILL[k] += g > GATE_ON and p < PROMPT_LEN[k]
        GATED_DECODE[k]  += g > GATE_ON and p >= PROMPT_LEN[k]
        FIRST_DECODE_GATED[k] = min(., p)     where g > GATE_ON and p >= PROMPT_LEN[k]
        FIRST_GATED[k] = min(., p)            where g > GATE_ON
    MAX_SCORE[k] = max(., score_key(s))      (NaN scores are ignored)
    FIRST_DYNAMIC[k] = min(., p)             where g > DYNAMIC_EPSILON and p >= DYNAMIC_FROM[k]
    UPTO[k] = max(., p + 1)
    NEXT[k] = max(., p + 1)

and then ``FRONTIER = UPTO`` and, for slots with tokens in the step, ``START = NEXT``
(``NEXT = 0`` again). :func:`fold_numpy` is that, in numpy (the CPU implementation and
the reference of the Triton kernels, :func:`.kernels.gate_stats.stats_step_triton`). Every update
is order-free (sums, minima, maxima), so the kernel uses atomics.

Order within a step: read-outs (requests that finished before it: their last step was folded
by the previous replay), then writes (requests admitted to it, perhaps in a slot just read
out), then the fold. The stream orders every upload, replay and copy.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from ..prefix_guard.guard import DYNAMIC_EPSILON, NONE
from . import cuda_events
from .layout import (
    DYNAMIC_FROM,
    FIRST_DECODE_GATED,
    FIRST_DYNAMIC,
    FIRST_GATED,
    FRONTIER,
    GATE,
    GATE_ON,
    GATED_DECODE,
    GATED_PREFILL,
    INDEX_POS,
    INDEX_PROBE,
    INDEX_SLOT,
    MAX_SCORE,
    MONITORED,
    NEXT,
    OPS_HEAD,
    POS_ABSOLUTE,
    PROMPT_LEN,
    SCORE,
    SITE,
    START,
    STAT_COLS,
    UPTO,
)
from .step_upload import Layout, StepUpload

COUNTERS = [MONITORED, GATED_PREFILL, GATED_DECODE, FIRST_DECODE_GATED, MAX_SCORE,
            FIRST_DYNAMIC, UPTO, FIRST_GATED]
"""What a request's summary reads (and a resumed request gets back)."""
NO_SCORE = np.iinfo(np.int64).min
"""``MAX_SCORE`` of a request without a (non-NaN) score yet."""
RING = 4
"""Replays in flight; a fifth waits for the oldest."""
OPS_IDLE = np.array([0, 0, 1], dtype=np.int64)
"""The op buffer's head with nothing queued (each replay leaves it so): no read-outs, no
writes, fold."""


def score_key(scores: np.ndarray) -> np.ndarray:
    """float32 scores as int64 keys ordered like the floats (``-0.0`` just below ``0.0``)."""
    bits = np.asarray(scores, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def key_score(key: int) -> float | None:
    """The score of a key (None: :data:`NO_SCORE`)."""
    if key == NO_SCORE:
        return None
    bits = key if key >= 0 else key ^ 0x7FFFFFFF
    return float(np.array([bits], dtype=np.int64).astype(np.int32).view(np.float32)[0])


def fresh_column(prompt_len: int, dynamic_from: int, site: int) -> np.ndarray:
    """A new request's column."""
    column = np.zeros(STAT_COLS, dtype=np.int64)
    column[[FIRST_DYNAMIC, FIRST_DECODE_GATED, FIRST_GATED]] = NONE
    column[MAX_SCORE] = NO_SCORE
    column[PROMPT_LEN], column[DYNAMIC_FROM], column[SITE] = prompt_len, dynamic_from, site
    return column


def fold_numpy(index: np.ndarray, gate_score: np.ndarray, stats: np.ndarray,
               site_counts: np.ndarray) -> None:
    """Fold one step (every column of ``index`` with a probe row) in place (module
    docstring)."""
    t = np.flatnonzero(index[INDEX_PROBE])
    t = t[index[INDEX_SLOT, t] < stats.shape[1]]  # a slot past the table is not counted
    if t.size:
        k = index[INDEX_SLOT, t].astype(np.int64)
        e = index[INDEX_POS, t].astype(np.int64)
        p = np.where(e & POS_ABSOLUTE, e & ~POS_ABSOLUTE, stats[START, k] + e)
        g, s = gate_score[GATE, t], gate_score[SCORE, t]
        on = g > GATE_ON
        site, sites, slots = stats[SITE, k], len(site_counts), stats.shape[1]
        site_counts[:, 0] += np.bincount(site, minlength=sites)
        site_counts[:, 1] += np.bincount(site[on], minlength=sites)
        new = p >= stats[FRONTIER, k]
        prompt = p < stats[PROMPT_LEN, k]
        decode_on = new & on & ~prompt
        stats[MONITORED] += np.bincount(k[new], minlength=slots)
        stats[GATED_PREFILL] += np.bincount(k[new & on & prompt], minlength=slots)
        stats[GATED_DECODE] += np.bincount(k[decode_on], minlength=slots)
        np.minimum.at(stats[FIRST_DECODE_GATED], k[decode_on], p[decode_on])
        np.minimum.at(stats[FIRST_GATED], k[new & on], p[new & on])
        scored = ~np.isnan(s)
        np.maximum.at(stats[MAX_SCORE], k[scored], score_key(s[scored]))
        hot = (g > DYNAMIC_EPSILON) & (p >= stats[DYNAMIC_FROM, k])
        np.minimum.at(stats[FIRST_DYNAMIC], k[hot], p[hot])
        np.maximum.at(stats[UPTO], k, p + 1)
        np.maximum.at(stats[NEXT], k, p + 1)
    stats[FRONTIER] = stats[UPTO]
    stats[START] = np.where(stats[NEXT] > 0, stats[NEXT], stats[START])
    stats[NEXT] = 0


def ops_layout(slots: int) -> Layout:
    """The op buffer's region of a :class:`.StepUpload` (room for every slot's read-out and
    write)."""
    return {"gate_ops": ((OPS_HEAD + (2 + STAT_COLS) * slots,), np.int64)}


class GateStats:
    """Owns the device statistics; folds steps into them and reads them back.

    ``upload``: the step's shared uploads, with :func:`ops_layout`'s region for ``slots``
    (None: uploads of its own). The op buffer goes to the device with the step's other
    uploads; its replay resets the buffer's head, and :meth:`flush` resets the host's mirror
    the same way, so no later upload repeats the ops."""

    def __init__(self, index: torch.Tensor, gate_score: torch.Tensor, sites: int,
                 slots: int, upload: StepUpload | None = None) -> None:
        device = index.device
        self._index, self._gate_score = index, gate_score
        self.stats = torch.zeros(STAT_COLS, slots, dtype=torch.int64, device=device)
        self.site_counts = torch.zeros(sites, 2, dtype=torch.int64, device=device)
        self.folds = 0
        """Replays (CPU: folds) queued so far."""
        self._writes: dict[int, np.ndarray] = {}
        """Slot -> column to write with the next step."""
        self._reads: list[tuple[int, Any]] = []
        """(slot, owner) of finished requests whose columns are to be read out."""
        self._landed: list[tuple[Any, np.ndarray]] = []
        self._due = 0
        """Tokens of the step begun last while its replay is due (-1: due, no gated token)."""
        self._written_at = np.zeros(slots, dtype=np.int64)
        """The replay that applies each slot's last write (older snapshots predate it)."""
        self._last_write = 0
        """The replay that applies the last write of any slot."""
        self._snapshot = np.zeros((2, slots), dtype=np.int64)
        self._snapshot_folds = 0
        """Replays the snapshot includes."""
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._upload = upload or StepUpload(ops_layout(slots), device)
            self._ops = self._upload.region("gate_ops")
            self._ops_np = self._upload.host("gate_ops")
            """The op buffer's host mirror (see :mod:`.step_upload`): its head is the device's
            after a replay, ``[0, 0, 1]`` (no ops; fold)."""
            self._ops_np[:OPS_HEAD] = OPS_IDLE
            self._ops[2] = 1
            self._readout = torch.zeros(STAT_COLS, slots, dtype=torch.int64, device=device)
            self._snap_host = [torch.zeros(2, slots, dtype=torch.int64).pin_memory()
                               for _ in range(RING)]
            self._read_host = [torch.zeros(STAT_COLS, slots, dtype=torch.int64).pin_memory()
                               for _ in range(RING)]
            # numpy views made once (a tensor method call costs host time)
            self._snap_np = [t.numpy() for t in self._snap_host]
            self._read_np = [t.numpy() for t in self._read_host]
            self._events = [torch.cuda.Event() for _ in range(RING)]
            self._graphs = {(ring, reads): self._capture(ring, reads)
                            for ring in range(RING) for reads in (False, True)}
            self._quiet = self._capture(None, False)
            """A replay that copies nothing back (:meth:`flush`'s ``quiet``)."""
            self._recorded = 0
            """Replays recorded so far (with their copies and an event): the next one's ring
            buffer is this modulo ``RING``."""
            self._unrecorded = False
            """The newest replay was quiet: no snapshot of it will land."""
            self._fresh = False
            """The newest replay in flight was flushed since the step began (not queried)."""
            self._in_flight: deque[tuple[int, int, list[Any]]] = deque()
            """(replay, ring buffer, owners of its read-outs)."""
            self._owners: list[Any] = []
            """Owners of the read-outs uploaded for the next replay."""

    # ---- per step ---------------------------------------------------------------------
    def begin_step(self, tokens: int, gated: bool) -> None:
        """Before a step's forward (and its index fill): queue the pending read-outs and
        writes; the step's replay is due after its forward when it has gated tokens (or
        anything was queued)."""
        queued = bool(self._reads or self._writes)
        if queued:
            self._apply(gated)
        self._due = tokens if gated else (-1 if queued else 0)
        self._fresh = False

    def flush(self, quiet: bool = False) -> None:
        """Queue the due replay (after the forward of the step begun last, before its index
        is refilled). ``quiet``: nobody needs this step's snapshot (the prefix guard's report
        has settled), so unless the replay reads out or writes a column it copies nothing
        back and records no event: the replay alone, with no event record and no event
        query per step (on CUDA; each such call costs ~10 µs of the engine's host time)."""
        if not self._due:
            return
        tokens, self._due = max(self._due, 0), 0
        self.folds += 1
        if not self._cuda:
            fold_numpy(self._index.numpy()[:, :tokens], self._gate_score.numpy()[:, :tokens],
                       self.stats.numpy(), self.site_counts.numpy())
            self._snapshot, self._snapshot_folds = self.stats[:2].numpy().copy(), self.folds
            return
        quiet = quiet and not (self._ops_np[0] or self._ops_np[1])  # no read-out, no write
        if not quiet and len(self._in_flight) == RING:  # the ring's last replay must land
            self._land(wait=True, limit=1)
        owners, self._owners = self._owners, []
        self._upload.send()  # this step's ops, if no upload carried them yet
        self._ops_np[:OPS_HEAD] = OPS_IDLE  # as the replay leaves the device's
        self._unrecorded = quiet
        if quiet:
            self._quiet.replay()
            return
        ring, self._recorded = self._recorded % RING, self._recorded + 1
        self._graphs[ring, bool(owners)].replay()
        cuda_events.record(self._events[ring], self.stats.device.index)
        self._in_flight.append((self.folds, ring, owners))
        self._fresh = True

    @property
    def snapshot_folds(self) -> int:
        """The replays the newest snapshot taken (by :meth:`take`) includes: while this
        number stays, no frontier of :meth:`frontiers` can have grown."""
        return self._snapshot_folds

    def frontiers(self) -> tuple[np.ndarray, np.ndarray]:
        """(processed frontier, first dynamic position) of every slot as of the newest
        replay :meth:`take` saw land; a slot written since holds its previous request's
        values there (:meth:`current` tells them apart)."""
        return self._snapshot[1], self._snapshot[0]

    def current(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` :meth:`frontiers` describes: those not written since the
        snapshot's replay (a request admitted since has no fold landed yet)."""
        return self._written_at[slots] <= self._snapshot_folds

    def all_current(self) -> bool:
        """Whether :meth:`frontiers` describes every slot: no write pending, none applied
        after the snapshot's replay."""
        return not self._writes and self._last_write <= self._snapshot_folds

    def write(self, slot: int, column: np.ndarray) -> None:
        """Set the slot's column with the next step (after the read-outs asked for before)."""
        self._writes[slot] = column

    def read(self, slot: int, owner: Any) -> None:
        """Read the slot's column out with the next step; :meth:`take` yields it with
        ``owner`` once it has landed."""
        pending = self._writes.pop(slot, None)
        if pending is not None:  # no step ran since it was written: that is its column
            self._landed.append((owner, pending.copy()))
        else:
            self._reads.append((slot, owner))

    def lower_first_dynamic(self, slot: int, position: int) -> None:
        """``FIRST_DYNAMIC = min(., position)`` for the slot (a controller's switch)."""
        pending = self._writes.get(slot)
        if pending is not None:
            pending[FIRST_DYNAMIC] = min(int(pending[FIRST_DYNAMIC]), position)
        else:
            self.stats[FIRST_DYNAMIC, slot:slot + 1].clamp_(max=position)

    def take(self, wait: bool = False) -> list[tuple[Any, np.ndarray]]:
        """Finished requests' read-outs that landed (``wait``: all queued): (owner, column)."""
        if self._cuda:
            self._land(wait)
        landed, self._landed = self._landed, []
        return landed

    # ---- queries (may wait) -----------------------------------------------------------
    def drain(self) -> None:
        """Apply what is pending and wait for every replay (the snapshot then includes
        them all)."""
        self.flush()
        # A replay that applies what is queued and folds nothing; after a quiet one (on
        # CUDA: no snapshot of it will land) it also copies the snapshot back.
        if self._reads or self._writes or (self._cuda and self._unrecorded):
            self._apply(False)
            self._due = -1
            self.flush()
        if self._cuda:
            self._land(wait=True)

    def column(self, slot: int) -> np.ndarray:
        """A live slot's column now (applies what is pending; waits)."""
        self.drain()
        return self.stats[:, slot].cpu().numpy()

    def site_totals(self) -> np.ndarray:
        """``site_counts`` now (waits)."""
        return self.site_counts.cpu().numpy()

    # ---- internals --------------------------------------------------------------------
    def _apply(self, gated: bool) -> None:
        """Queue the pending read-outs and writes: a few scalar writes per request, its
        admission's or finish's share (a step admits few; whole-array calls cost more)."""
        reads, self._reads = self._reads, []
        writes, self._writes = self._writes, {}
        for slot in writes:
            self._written_at[slot] = self.folds + 1
        if writes:
            self._last_write = self.folds + 1
        if not self._cuda:
            stats = self.stats.numpy()
            self._landed += [(owner, stats[:, slot].copy()) for slot, owner in reads]
            for slot, column in writes.items():
                stats[:, slot] = column
            return
        ops = self._ops_np
        r, w = len(reads), len(writes)
        ops[0], ops[1], ops[2] = r, w, gated
        for at, (slot, _) in enumerate(reads, OPS_HEAD):
            ops[at] = slot
        columns = OPS_HEAD + r + w  # where the written columns start
        for k, (slot, column) in enumerate(writes.items()):
            ops[OPS_HEAD + r + k] = slot
            ops[columns + STAT_COLS * k:columns + STAT_COLS * (k + 1)] = column
        self._upload.changed("gate_ops")
        self._owners = [owner for _, owner in reads]

    def _capture(self, ring: int | None, reads: bool) -> torch.cuda.CUDAGraph:
        """A step's replay into ring buffer ``ring`` (``reads``: with the read-outs' copy;
        ``None``: no copy at all), compiled first, outside the capture (the op buffer and
        index are all zeros here, so running it changes nothing)."""
        from .kernels._tl import captured
        from .kernels.gate_stats import stats_step_triton

        def step() -> None:
            stats_step_triton(self._ops, self._index, self._gate_score, self.stats,
                              self.site_counts, self._readout)
            if ring is not None:
                self._snap_host[ring].copy_(self.stats[:2], non_blocking=True)
            if reads:
                self._read_host[ring].copy_(self._readout, non_blocking=True)

        return captured(step)

    def _land(self, wait: bool, limit: int | None = None) -> None:
        """Take what landed: every replay's read-outs, the newest snapshot (``wait``: wait
        for ``limit`` replays, default all). Replays land in stream order, so one event
        tells about every replay before it: ``wait`` waits on the last replay it takes, and
        otherwise the queries go from the newest back to the first that landed (one query on
        most steps), skipping the replay flushed since the step began (it runs behind the
        step's forward; the next step takes it)."""
        if wait:
            count = len(self._in_flight) if limit is None else min(limit, len(self._in_flight))
            if count:
                self._events[self._in_flight[count - 1][1]].synchronize()
        else:
            count = max(len(self._in_flight) - self._fresh, 0)  # (a wait took them all)
            while count and not self._events[self._in_flight[count - 1][1]].query():
                count -= 1
        for _ in range(count):
            folds, ring, owners = self._in_flight.popleft()
            if owners:
                columns = self._read_np[ring]
                self._landed += [(owner, columns[:, i].copy()) for i, owner in enumerate(owners)]
            # copied now: a later replay may reuse the ring buffer while this stays newest
            self._snapshot, self._snapshot_folds = self._snap_np[ring].copy(), folds
