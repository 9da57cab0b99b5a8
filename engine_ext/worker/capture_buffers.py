"""Worker side of activation capture: the capture buffer, its lanes and the rows of requests.

A request whose spec has ``capture`` (``extra_args["dynsteer_activations"]``, see
:mod:`..frontend.request_capture`; the probe-training path, :mod:`..frontend.capture`, sends
such requests too) is captured into the buffer ``capture[K, C + 1, H]`` (float32): at
admission it takes a *lane* for each of its sites and one row per position it may compute (its
prompt and ``max_tokens - 1`` generated positions), prompt and generated tokens alike;
:meth:`~CaptureBuffers.collect_requests` returns the positions it named and frees both.

A lane is the per-site table ``site_lane`` the in-graph op reads (:mod:`.ops`); lanes are
shared by site and counted, so requests capturing the same site share one lane and a lane is
reassigned only when nobody holds it. A token writes the stream of every site that has a lane
into its own row of that lane; a request reads only its own sites' lanes. Every TP rank
receives the same calls and scheduler outputs in the same order, so rows are identical on all
of them; only TP rank 0 sends data back (the residual stream is replicated after the
all-reduce).

Rows outlive their request: the frontend collects after the request's output came back, which
can be before this worker even hears that the request finished. A finished request's rows and
lanes are kept until collected; when a new request needs the room or a lane, those of requests
that left the batch longest ago are reused (collecting them then reports ``dropped``). Row 0
is never handed out (0 means "not captured" in the token index, so padding and a cleared index
never write).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynsteer.controller.contract import Site, parse_site_name, site_name
from dynsteer.controller.extra_args import ACTIVATIONS_KEY
from dynsteer.controller.positions import select

from ..compat.worker import is_internal_id_of
from .capture_encode import encode
from .capture_transfer import RowsSender

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

GONE = 4096
"""Requests whose capture was dropped that the worker remembers (to say so when collected)."""
_UNSEEN = np.iinfo(np.int64).max


@dataclass
class _Entry:
    """The capture rows of one request."""

    req_id: str
    start: int
    """First row; position ``p`` is row ``start + p``."""
    length: int
    """Rows (positions ``0 .. length - 1``)."""
    prompt_len: int
    lanes: tuple[int, ...]
    """The lanes of the sites it asked for (held until collected)."""
    wanted: dict[str, Any]
    """Its ``sites`` / ``positions`` / ``dtype`` and the rest of :data:`ACTIVATIONS_KEY`."""
    slot: int | None = None
    """The request's slot while it is live (its tokens write), else None."""
    first: int = -1
    """Lowest position seen computed (-1: none yet)."""
    end: int = 0
    """One past the highest position seen computed."""


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
        """Per site (forward order): its lane, -1 when not captured."""
        self.installed: frozenset[Site] = frozenset(sites)
        """Sites whose op runs on this worker (a pipeline stage has only its own layers)."""
        self._site_index = {site: i for i, site in enumerate(sites)}
        self._lane_site: list[Site | None] = [None] * lanes
        self._lane_refs = [0] * lanes
        self._requests: dict[str, _Entry] = {}
        """Request captures, by request id."""
        self._left: OrderedDict[str, None] = OrderedDict()
        """Request captures whose request left the batch, longest ago first (reused first)."""
        self._gone: OrderedDict[str, str] = OrderedDict()
        """Request captures dropped (request id -> why), most recent last (bounded)."""
        self._by_slot: dict[int, _Entry] = {}
        self._slot_start = np.zeros(max_slots, dtype=np.int64)
        """Per slot: the first capture row of the request in it (0: not captured)."""
        self._slot_len = np.zeros(max_slots, dtype=np.int64)
        self._slot_first = np.full(max_slots, _UNSEEN, dtype=np.int64)
        self._slot_end = np.zeros(max_slots, dtype=np.int64)
        self._sender = RowsSender()

    # ---- request captures ----------------------------------------------------------------
    def collect_requests(self, requests: list[tuple[str, int | None, int]], reply: bool,
                         first_gated: Callable[[str], int | None] = lambda _: 0,
                         inbox: dict[str, str] | None = None,
                         keep: bool = False) -> dict[str, Any] | None:
        """The captured positions of requests (each by its id or the caller's id of it), then
        freed; None on TP ranks other than 0.

        ``requests``: (id, computed, since) triples; ``computed`` is how many positions the
        request computed, as its output says (prompt plus generated tokens, less one); None:
        as far as this worker saw; only positions from ``since`` on are returned (those
        before went out already). ``first_gated(req_id)``: the first position whose gate
        fired (None: none; a ``when: "gated"`` capture keeps its rows only if there is one,
        and only those within its ``window`` of it; otherwise they are freed without leaving
        the device). ``inbox``: where the frontend takes the rows (:mod:`.capture_transfer`).
        ``keep``: read the rows computed so far of requests that may still be running, and
        free nothing (a stream's rows as it goes); only a capture whose rows stream
        (:attr:`~dynsteer.controller.spec.CaptureSpec.streams`) is read so, the others reply
        None.

        Reply: ``file`` (the inbox file holding the rows, or None) and per request, in order,
        None (it asked for no capture) or ``status`` (``ok`` / ``skipped`` / ``partial`` /
        ``dropped``), ``detail``, ``sites`` (``hook@layer``), ``hidden`` (a row's width: ``k``
        when projected), ``dtype``, ``positions`` (little-endian int64 bytes), the rows
        ``[sites, positions, hidden]`` (:mod:`.capture_encode`) as ``data`` or as ``offset`` /
        ``nbytes`` in the file, ``rows`` per site (one with ``reduce: mean``), and ``scales``
        (int8: one float32 per row).
        """
        taken = [self._take(request_id, computed, since, reply, first_gated, keep)
                 for request_id, computed, since in requests]
        if not reply:
            return None
        blobs = [blob for _, blob in taken if blob is not None]
        file, placed = self._sender.send(blobs, inbox)
        where = iter(placed)
        items = [None if answer is None
                 else {**answer, **(next(where) if blob is not None else {})}
                 for answer, blob in taken]
        return {"file": file, "items": items}

    def _take(self, request_id: str, computed: int | None, since: int, reply: bool,
              first_gated: Callable[[str], int | None], keep: bool
              ) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
        """One request's reply (without its rows) and its rows' bytes on the device; unless
        ``keep``, its rows and lanes are free once the bytes are copied out."""
        req_id = self._find(request_id)
        if req_id is None:
            gone = next((g for g in self._gone if g == request_id
                         or is_internal_id_of(g, request_id)), None)
            if gone is None or not reply:
                return None, None
            return self._nothing("dropped", self._gone[gone]), None
        entry = self._requests[req_id]
        wanted = entry.wanted
        if keep:
            if not reply or not wanted.get("stream"):
                return None, None
            first, end = self._seen(entry)
        else:
            del self._requests[req_id]
            self._left.pop(req_id, None)
            self._detach(entry)
            self._release(entry.lanes)
            first, end = entry.first, entry.end
        fired = first_gated(req_id) if wanted.get("when") == "gated" else None
        if wanted.get("when") == "gated" and fired is None:
            return {**self._nothing("skipped", "the request's gate never fired"),
                    "dtype": wanted["dtype"]}, None
        if not reply:
            return None, None
        end = end if computed is None else min(end, computed)
        positions = select(wanted["positions"], entry.prompt_len, max(end, 0))
        positions = positions[positions >= since]
        if fired is not None and wanted.get("window") is not None:
            before, after = wanted["window"]
            positions = positions[(positions >= fired - before) & (positions <= fired + after)]
        seen = positions[positions >= first] if first >= 0 else positions[:0]
        status, detail = "ok", ""
        if len(seen) < len(positions):
            status = "partial"
            detail = (f"positions {int(positions[0])}..{max(first, 0) - 1} were not "
                      "computed by this request (taken from the prefix cache)")
        sites = [self._lane_site[lane] for lane in entry.lanes]
        mine = [i for i, site in enumerate(sites) if site in self.installed]
        index = torch.as_tensor(entry.start + seen, device=self.capture.device)
        lanes = self._lane_index([entry.lanes[i] for i in mine])
        rows = self.capture[lanes[:, None], index[None, :]]  # [sites, positions, hidden]
        if wanted.get("reduce") == "mean" and len(seen):
            rows = rows.mean(dim=1, keepdim=True)
        data, scales, width = encode(rows, wanted["dtype"], wanted.get("project"))
        return {"status": status, "detail": detail,
                "sites": [site_name(sites[i]) for i in mine if sites[i] is not None],
                "hidden": width, "rows": rows.shape[1], "dtype": wanted["dtype"],
                "positions": seen.astype("<i8").tobytes(), "scales": scales}, data

    # ---- request lifecycle and steps -----------------------------------------------------
    def admit(self, req_id: str, slot: int, extra_args: Any, prompt_len: int) -> None:
        """Give a request that asked for capture its lanes and rows (a re-added one keeps
        them)."""
        wanted = extra_args.get(ACTIVATIONS_KEY) if isinstance(extra_args, dict) else None
        if wanted is None:
            return
        entry = self._requests.get(req_id)
        if entry is None:
            entry = self._new_request_entry(req_id, wanted, prompt_len)
            if entry is None:
                return
            self._requests[req_id] = entry
        self._left.pop(req_id, None)
        self._attach(entry, slot)

    def detach(self, req_id: str) -> None:
        """The request left the batch: its tokens stop writing (its rows wait for collect)."""
        entry = self._requests.get(req_id)
        if entry is not None:
            self._detach(entry)
            self._left[req_id] = None

    @property
    def active(self) -> bool:
        """Whether some live request is being captured (the step index must be filled)."""
        return bool(self._by_slot)

    def slot_starts(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """First capture row and rows per request of the step (None: nobody is captured)."""
        if not self._by_slot:
            return None
        return self._slot_start[slots], self._slot_len[slots]

    def record(self, slots: np.ndarray, starts: np.ndarray, num_computed: np.ndarray,
               num_scheduled: np.ndarray) -> None:
        """Note which positions of captured requests this step computes."""
        captured = starts != 0
        mine = np.asarray(slots)[captured]
        first = num_computed[captured].astype(np.int64)
        self._slot_first[mine] = np.minimum(self._slot_first[mine], first)
        self._slot_end[mine] = np.maximum(
            self._slot_end[mine],
            np.minimum(first + num_scheduled[captured], self._slot_len[mine]))

    @property
    def rows_in_use(self) -> int:
        return sum(e.length for e in self._requests.values())

    # ---- internals -----------------------------------------------------------------------
    def _seen(self, entry: _Entry) -> tuple[int, int]:
        """(lowest position computed or -1, one past the highest) of a request, live or not."""
        if entry.slot is None:
            return entry.first, entry.end
        first = int(self._slot_first[entry.slot])
        return (-1 if first == _UNSEEN else first), int(self._slot_end[entry.slot])

    def _new_request_entry(self, req_id: str, wanted: dict[str, Any],
                           prompt_len: int) -> _Entry | None:
        try:
            sites = [self._parse_site(s) for s in wanted["sites"]]
            rows = int(wanted["rows"])
        except (KeyError, TypeError, ValueError) as e:
            return self._drop(req_id, f"malformed capture: {e}")
        lanes = self._acquire(sites)
        while lanes is None and self._left:
            self._evict_oldest()
            lanes = self._acquire(sites)
        if lanes is None:
            return self._drop(req_id, f"no free capture lanes for {len(sites)} sites "
                                      "(dynsteer.capture_lanes) when the request ran")
        self._publish_lanes()
        start = self._allocate(rows)
        if start is None:
            self._release(lanes)
            return self._drop(req_id, f"no {rows} free capture rows (dynsteer.capture_tokens "
                                      f"is {self.capacity}) when the request ran")
        return _Entry(req_id=req_id, start=start, length=rows, prompt_len=prompt_len,
                      lanes=lanes, wanted=wanted)

    def _nothing(self, status: str, detail: str) -> dict[str, Any]:
        return {"status": status, "detail": detail, "sites": [], "hidden": self.hidden_size,
                "dtype": "float32", "positions": b"", "data": b"", "scales": b""}

    def _drop(self, req_id: str, why: str) -> None:
        logger.warning("dynsteer: request %s runs uncaptured: %s", req_id, why)
        self._gone[req_id] = why
        while len(self._gone) > GONE:
            self._gone.popitem(last=False)
        return None

    def _find(self, request_id: str) -> str | None:
        if request_id in self._requests:
            return request_id
        matches = [r for r in self._requests if is_internal_id_of(r, request_id)]
        return matches[-1] if matches else None

    def _parse_site(self, name: str) -> Site:
        try:
            site: Site | None = parse_site_name(name)
        except ValueError:
            site = None
        if site is None or site not in self.monitors:
            raise ValueError(f"sites: {name!r} is not a monitor site; add it to the engine "
                             "option dynsteer.monitor_sites")
        return site

    def _acquire(self, sites: list[Site]) -> tuple[int, ...] | None:
        """A lane per site (shared with whoever holds that site's), counted; None (nothing
        taken) when there are not enough free lanes."""
        lanes: list[int] = []
        for site in sites:
            lane = next((i for i, s in enumerate(self._lane_site)
                         if s == site and self._lane_refs[i] > 0), None)
            if lane is None:
                lane = next((i for i, refs in enumerate(self._lane_refs)
                             if refs == 0 and i not in lanes), None)
            if lane is None:
                for taken in lanes:
                    self._lane_refs[taken] -= 1
                return None
            self._lane_site[lane] = site
            self._lane_refs[lane] += 1
            lanes.append(lane)
        return tuple(lanes)

    def _release(self, lanes: tuple[int, ...]) -> None:
        for lane in lanes:
            self._lane_refs[lane] -= 1
        if lanes:
            self._publish_lanes()

    def _publish_lanes(self) -> None:
        """The site -> lane table the graph reads (issued on the current stream, so ordered
        after every forward that read the old one)."""
        table = torch.full((len(self.sites),), -1, dtype=torch.int32)
        for lane, site in enumerate(self._lane_site):
            if site is not None and self._lane_refs[lane] > 0:
                table[self._site_index[site]] = lane
        self.site_lane.copy_(table.to(self.site_lane.device))

    def _lane_index(self, lanes: list[int]) -> torch.Tensor:
        return torch.tensor(lanes, dtype=torch.long, device=self.capture.device)

    def _allocate(self, n: int) -> int | None:
        """First fit: the lowest start of ``n`` free consecutive rows in 1..C; the rows of
        requests that left the batch longest ago are reused until it fits."""
        while True:
            start = 1
            for entry in sorted(self._requests.values(), key=lambda e: e.start):
                if entry.start - start >= n:
                    break
                start = max(start, entry.start + entry.length)
            if start + n <= self.capacity + 1:
                return start
            if not self._left:
                return None
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Free the rows and lanes of the request that left the batch longest ago, uncollected."""
        oldest, _ = self._left.popitem(last=False)
        entry = self._requests.pop(oldest)
        self._release(entry.lanes)
        self._drop(oldest, "its rows were reused before they were collected (collect "
                           "activations as outputs arrive)")

    def _attach(self, entry: _Entry, slot: int) -> None:
        self._detach(entry)
        if slot >= len(self._slot_start):
            grow = slot + 1
            self._slot_start = np.concatenate([self._slot_start, np.zeros(grow, np.int64)])
            self._slot_len = np.concatenate([self._slot_len, np.zeros(grow, np.int64)])
            self._slot_first = np.concatenate([self._slot_first,
                                               np.full(grow, _UNSEEN, np.int64)])
            self._slot_end = np.concatenate([self._slot_end, np.zeros(grow, np.int64)])
        entry.slot = slot
        self._slot_start[slot] = entry.start
        self._slot_len[slot] = entry.length
        self._slot_first[slot] = entry.first if entry.first >= 0 else _UNSEEN
        self._slot_end[slot] = entry.end
        self._by_slot[slot] = entry

    def _detach(self, entry: _Entry) -> None:
        slot = entry.slot
        if slot is None:
            return
        entry.first, entry.end = self._seen(entry)
        self._slot_start[slot] = self._slot_len[slot] = self._slot_end[slot] = 0
        self._slot_first[slot] = _UNSEEN
        self._by_slot.pop(slot, None)
        entry.slot = None
