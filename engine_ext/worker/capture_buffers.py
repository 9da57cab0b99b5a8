"""Worker side of activation capture: the capture buffer, its lanes and the rows of prompts.

One capture (planned and driven by the frontend, :mod:`.capture`) runs in passes. A pass
starts with :meth:`CaptureBuffers.begin`, which gives each of at most K sites a *lane* (the
per-site table ``site_lane`` the in-graph op reads). A request whose ``extra_args`` carry
``{"dynsteer_capture": "<ticket>:<item>"}`` with the pass's ticket gets, at admission, a
contiguous range of capture rows, one per prompt position; its prompt tokens then store the
residual stream into ``capture[lane, row]`` at every site that has a lane (:mod:`.ops`).
:meth:`~CaptureBuffers.collect` reads (and reduces) the rows of finished requests and frees
them; :meth:`~CaptureBuffers.end` clears the lanes. Every TP rank receives the same calls and
scheduler outputs in the same order, so rows are identical on all of them; only TP rank 0
sends data back (the residual stream is replicated after the all-reduce).

Rows outlive their request: the frontend collects after the request's output came back, which
can be before this worker even hears that the request finished. Row 0 is never handed out (0
means "not captured" in the token index, so padding and a cleared index never write).
The ticket makes stale or forged capture requests harmless: a request whose ticket is not the
current pass's gets no rows, so it can neither write into another capture's rows nor starve it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dynsteer.controller.contract import Site, f32_bytes, parse_site_name, site_name
from dynsteer.controller.extra_args import CAPTURE_KEY

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

Reduce = Literal["last", "mean", "all"]
REDUCES: tuple[Reduce, ...] = ("last", "mean", "all")
"""Per prompt: the last prompt token, the mean over prompt tokens, or every prompt token."""


def capture_key(ticket: str, item: int) -> str:
    """The ``extra_args`` value that marks prompt ``item`` of the pass ``ticket``."""
    return f"{ticket}:{item}"


@dataclass
class _Entry:
    """The capture rows of one prompt."""

    req_id: str
    start: int
    """First row; position ``p`` of the prompt is row ``start + p``."""
    length: int
    slot: int | None = None
    """The request's slot while it is live (its prompt tokens write), else None."""
    first: int = -1
    """Lowest position seen computed (-1: none yet)."""
    end: int = 0
    """One past the highest prompt position seen computed."""

    def complete(self) -> bool:
        return self.first == 0 and self.end == self.length


class CaptureBuffers:
    """The capture buffer ``[K, C + 1, H]`` (float32), the lane table and the row allocator."""

    def __init__(self, sites: tuple[Site, ...], lanes: int, capacity: int, hidden_size: int,
                 max_slots: int, device: torch.device, monitors: frozenset[Site]) -> None:
        self.sites = sites
        self.monitors = monitors
        """Sites whose op can capture (the others are fused into the next layer's kernels)."""
        self.lanes = lanes
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.capture = torch.zeros(lanes, capacity + 1, hidden_size, dtype=torch.float32,
                                   device=device)
        """Rows 1..C of each lane; row 0 is never written."""
        self.site_lane = torch.full((len(sites),), -1, dtype=torch.int32, device=device)
        """Per site (forward order): its lane in this pass, -1 when not captured."""
        self.installed: frozenset[Site] = frozenset(sites)
        """Sites whose op runs on this worker (a pipeline stage has only its own layers)."""
        self._site_index = {site: i for i, site in enumerate(sites)}
        self.ticket: str | None = None
        self._lane_sites: tuple[Site, ...] = ()
        self._entries: dict[str, _Entry] = {}
        """By capture key."""
        self._key_of: dict[str, str] = {}
        """Capture key of each live request that has rows."""
        self._by_slot: dict[int, _Entry] = {}
        self._slot_start = np.zeros(max_slots, dtype=np.int64)
        """Per slot: the first capture row of the request in it (0: not captured)."""

    # ---- control (RPCs) ------------------------------------------------------------------
    def begin(self, ticket: str, sites: list[str]) -> None:
        """Start a pass: ``sites`` (``hook@layer``, at most K) get lanes 0.. in that order.

        A pass still open with another ticket is superseded (its rows are freed, so its collect
        reports them missing): a frontend that died mid-capture cannot block the engine.
        """
        if self.lanes == 0:
            raise ValueError("activation capture is off on this engine (dynsteer.capture_lanes "
                             "is 0); restart it with capture_lanes >= 1")
        parsed = [self._parse_site(s) for s in sites]
        if not parsed or len(parsed) > self.lanes:
            raise ValueError(f"sites: {len(parsed)} sites in one capture pass, expected 1 to "
                             f"{self.lanes} (dynsteer.capture_lanes)")
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"sites: duplicate site in {sites}")
        if self.ticket is not None and self.ticket != ticket:
            logger.warning("dynsteer: capture pass %s supersedes %s, which never ended", ticket,
                           self.ticket)
        self._reset()
        table = torch.full((len(self.sites),), -1, dtype=torch.int32)
        for lane, site in enumerate(parsed):
            table[self._site_index[site]] = lane
        # Issued on the current stream: ordered after every forward that read the old table.
        self.site_lane.copy_(table.to(self.site_lane.device))
        self.ticket = ticket
        self._lane_sites = tuple(parsed)

    def end(self, ticket: str | None = None) -> None:
        """Close the pass ``ticket`` (None: whichever is open): no site is captured, every row
        is free. Ending a pass that was superseded does nothing, so it cannot end its
        successor."""
        if ticket is not None and ticket != self.ticket:
            return
        self._reset()
        self.site_lane.fill_(-1)
        self.ticket = None
        self._lane_sites = ()

    def collect(self, keys: list[str], reduce: str, reply: bool) -> dict[str, Any] | None:
        """Free the rows of ``keys``; with ``reply``, return them reduced (JSON/msgpack-safe).

        Reply: ``sites`` (this worker's lanes, in lane order), ``hidden``, ``reduce``, ``items``
        (key -> ``tokens`` (prompt length) and ``data``: bytes of little-endian float32
        ``[len(sites), 1 or tokens, hidden]``) and ``missing`` (key -> why it has no rows).
        """
        if reduce not in REDUCES:
            raise ValueError(f"reduce: {reduce!r} is not one of {', '.join(REDUCES)}")
        if reply and self.capture.is_cuda:
            torch.cuda.synchronize(self.capture.device)  # rare RPC; forwards may be in flight
        lanes = [(lane, site) for lane, site in enumerate(self._lane_sites)
                 if site in self.installed]
        lane_index = torch.tensor([lane for lane, _ in lanes], dtype=torch.long,
                                  device=self.capture.device)
        items: dict[str, dict[str, Any]] = {}
        missing: dict[str, str] = {}
        for key in keys:
            entry = self._entries.pop(key, None)
            if entry is None:
                missing[key] = ("the engine gave it no capture rows (stale ticket, another "
                                "capture started, or no free rows; see the engine log)")
                continue
            self._detach(entry)
            if not entry.complete():
                missing[key] = (f"the engine computed prompt positions {max(entry.first, 0)}.."
                                f"{entry.end} of {entry.length} (a prefix-cache hit?)")
                continue
            if reply and lanes:
                rows = self.capture[:, entry.start:entry.start + entry.length]
                reduced = _reduce(rows.index_select(0, lane_index), reduce)
                items[key] = {"tokens": entry.length, "data": f32_bytes(reduced.cpu().numpy())}
        if not reply:
            return None
        return {"sites": [site_name(site) for _, site in lanes], "hidden": self.hidden_size,
                "reduce": reduce, "items": items, "missing": missing}

    # ---- request lifecycle and steps -----------------------------------------------------
    def admit(self, req_id: str, slot: int, extra_args: Any, prompt_len: int) -> None:
        """Give a capture request of the current pass its rows (others are ignored)."""
        raw = extra_args.get(CAPTURE_KEY) if isinstance(extra_args, dict) else None
        if raw is None:
            return
        key = str(raw)
        if self.ticket is None or key.rpartition(":")[0] != self.ticket:
            logger.warning("dynsteer: request %s has capture key %r, not of the open capture "
                           "pass; it runs uncaptured", req_id, key)
            return
        entry = self._entries.get(key)
        if entry is None or entry.req_id != req_id:  # a re-added request keeps its rows
            if entry is not None:
                self._detach(self._entries.pop(key))
            start = self._allocate(prompt_len)
            if start is None:
                logger.warning("dynsteer: no %d free capture rows for request %s (capacity %d)",
                               prompt_len, req_id, self.capacity)
                return
            entry = _Entry(req_id=req_id, start=start, length=prompt_len)
            self._entries[key] = entry
        self._detach(entry)
        if slot >= len(self._slot_start):
            self._slot_start = np.concatenate(
                [self._slot_start, np.zeros(slot + 1, dtype=np.int64)])
        entry.slot = slot
        self._slot_start[slot] = entry.start
        self._by_slot[slot] = entry
        self._key_of[req_id] = key

    def detach(self, req_id: str) -> None:
        """The request left the batch: its tokens stop writing (its rows wait for collect)."""
        key = self._key_of.pop(req_id, None)
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.req_id == req_id:
            self._detach(entry)

    @property
    def active(self) -> bool:
        """Whether some live request is being captured (the step index must be filled)."""
        return bool(self._by_slot)

    def slot_starts(self, slots: np.ndarray) -> np.ndarray | None:
        """First capture row per request of the step (None when nobody is captured)."""
        if not self._by_slot:
            return None
        return self._slot_start[slots]

    def record(self, slots: np.ndarray, starts: np.ndarray, num_computed: np.ndarray,
               num_scheduled: np.ndarray) -> None:
        """Note which prompt positions of captured requests this step computes."""
        for i in np.flatnonzero(starts):
            entry = self._by_slot[int(slots[i])]
            first = int(num_computed[i])
            entry.first = first if entry.first < 0 else min(entry.first, first)
            entry.end = max(entry.end, min(first + int(num_scheduled[i]), entry.length))

    @property
    def rows_in_use(self) -> int:
        return sum(e.length for e in self._entries.values())

    # ---- internals -----------------------------------------------------------------------
    def _parse_site(self, name: str) -> Site:
        try:
            site: Site | None = parse_site_name(name)
        except ValueError:
            site = None
        if site is None or site not in self.monitors:
            raise ValueError(f"sites: {name!r} is not a monitor site; add it to the engine "
                             "option dynsteer.monitor_sites")
        return site

    def _allocate(self, n: int) -> int | None:
        """First fit: the lowest start of ``n`` free consecutive rows in 1..C."""
        start = 1
        for entry in sorted(self._entries.values(), key=lambda e: e.start):
            if entry.start - start >= n:
                break
            start = max(start, entry.start + entry.length)
        return start if start + n <= self.capacity + 1 else None

    def _detach(self, entry: _Entry) -> None:
        if entry.slot is not None:
            self._slot_start[entry.slot] = 0
            self._by_slot.pop(entry.slot, None)
            entry.slot = None

    def _reset(self) -> None:
        for entry in self._entries.values():
            self._detach(entry)
        self._entries.clear()
        self._key_of.clear()


def _reduce(rows: torch.Tensor, reduce: str) -> torch.Tensor:
    """``[lanes, tokens, H]`` -> ``[lanes, 1 or tokens, H]`` (done on the device: less to copy)."""
    if reduce == "last":
        return rows[:, -1:]
    if reduce == "mean":
        return rows.mean(dim=1, keepdim=True)
    return rows

