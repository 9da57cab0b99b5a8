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

from ..compat.worker import caller_id, is_internal_id_of
from .capture_encode import encode
from .capture_sink import FLUSH_ROWS, EngineSink, Stretch
from .capture_transfer import RowsSender

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

GONE = 4096
"""Requests whose capture was dropped, or went to a sink, that the worker remembers (to say so
when collected)."""
_UNSEEN = np.iinfo(np.int64).max
_NO_SINK = np.iinfo(np.int64).max // 2
_STORED = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
           "bfloat16": np.dtype("<u2")}
"""How a sink stores rows of each dtype written as they are computed (bfloat16 as its bits)."""


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
    sink: str | None = None
    """The engine sink its rows go to (None: they wait for collect)."""
    span: tuple[int, int] | None = None
    """Positions ``lo .. hi - 1``, all selected: written to this worker's sink as they are
    computed (None: written when the request finishes, or not by this worker)."""
    flushed: int = 0
    """Positions below this went to the sink already."""
    blocks: dict[str, tuple[str, np.dtype, tuple[int, ...]]] | None = None
    """The blocks its sink reserves for it (made with its first stretch)."""


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
        self.sinks: dict[str, EngineSink] = {}
        """The engine's capture sinks this worker writes (TP rank 0 of each stage)."""
        self._slot_flushed = np.full(max_slots, _NO_SINK, dtype=np.int64)
        """Per slot: positions below this went to the sink (:data:`_NO_SINK`: not written as
        it runs)."""
        self._slot_sink = np.zeros(max_slots, dtype=bool)
        """Per slot: its request's capture names an engine sink."""
        self._sinking = 0
        """Live requests whose capture names an engine sink."""
        self._completing: list[_Entry] = []
        """Requests of engine sinks whose last row this step computes."""
        self._sunk: OrderedDict[str, str] = OrderedDict()
        """Requests whose rows went to a sink (request id -> sink), most recent last."""
        self._finishing: list[_Entry] = []
        """Finished requests of engine sinks not written yet (:meth:`finish_sinks`)."""
        self.first_gated: Callable[[str], int | None] = lambda _: 0
        """The first position whose gate fired of a request (set by its state)."""

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

        Reply: ``file`` and ``parts`` (the inbox files holding the rows, see
        :func:`..frontend.rows_inbox.parts`; None and 0: none) and per request, in order,
        None (it asked for no capture) or ``status`` (``ok`` / ``skipped`` / ``partial`` /
        ``dropped``), ``detail``, ``sites`` (``hook@layer``), ``hidden`` (a row's width: ``k``
        when projected), ``dtype``, ``positions`` (little-endian int64 bytes), the rows
        ``[sites, positions, hidden]`` (:mod:`.capture_encode`) as ``data`` or as ``part`` /
        ``offset`` / ``nbytes`` in the files, ``rows`` per site (one with ``reduce: mean``),
        and ``scales`` (int8: one float32 per row).
        """
        taken = [self._take(request_id, computed, since, reply, first_gated, keep)
                 for request_id, computed, since in requests]
        self.finish_sinks()
        if not reply:
            return None
        blobs = [blob for _, blob in taken if blob is not None]
        file, files, placed = self._sender.send(blobs, inbox)
        where = iter(placed)
        items = [None if answer is None
                 else {**answer, **(next(where) if blob is not None else {})}
                 for answer, blob in taken]
        return {"file": file, "parts": files, "items": items}

    def _take(self, request_id: str, computed: int | None, since: int, reply: bool,
              first_gated: Callable[[str], int | None], keep: bool
              ) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
        """One request's reply (without its rows) and its rows' bytes on the device; unless
        ``keep``, its rows and lanes are free once the bytes are copied out."""
        req_id = self._find(self._requests, request_id)
        if req_id is None:
            sunk = self._find(self._sunk, request_id)
            if sunk is not None:
                return (self._in_sink(self._sunk[sunk]) if reply else None), None
            gone = self._find(self._gone, request_id)
            if gone is None or not reply:
                return None, None
            return self._nothing("dropped", self._gone[gone]), None
        entry = self._requests[req_id]
        if entry.sink is not None:  # collected: its request finished
            if not keep and entry not in self._finishing:
                self._detach(entry)
                self._left.pop(req_id, None)
                self._finishing.append(entry)
            return (self._in_sink(entry.sink) if reply else None), None
        if keep:
            if not reply or not entry.wanted.get("stream"):
                return None, None
            first, end = self._seen(entry)
        else:
            del self._requests[req_id]
            self._left.pop(req_id, None)
            self._detach(entry)
            self._release(entry.lanes)
            first, end = entry.first, entry.end
        return self._read(entry, first, end, computed, since, first_gated, reply)

    def _read(self, entry: _Entry, first: int, end: int, computed: int | None, since: int,
              first_gated: Callable[[str], int | None], reply: bool
              ) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
        """A request's reply and rows (see :meth:`_take`) from the positions it computed,
        ``first`` .. ``end - 1``."""
        wanted = entry.wanted
        fired = first_gated(entry.req_id) if wanted.get("when") == "gated" else None
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

    # ---- engine sinks (see :mod:`.capture_sink`) -------------------------------------------
    def _in_sink(self, sink: str) -> dict[str, Any]:
        """What a collect says of a request whose rows go to an engine sink."""
        return {**self._nothing("ok", f"rows written to the engine's capture sink {sink!r}"),
                "sink": sink}

    def _to_sink(self, entries: list[_Entry], ends: np.ndarray, final: bool) -> None:
        """Send the rows that ``entries`` (written as they run) computed below ``ends`` and
        did not send yet, gathered per lanes and length in one read of the buffer each."""
        groups: dict[tuple[Any, ...], list[tuple[_Entry, int, Stretch]]] = {}
        by_sink: dict[str, list[Stretch]] = {}
        for entry, end in zip(entries, ends.tolist(), strict=True):
            assert entry.span is not None and entry.sink is not None
            lo, hi = entry.span
            first, _ = self._seen(entry)
            start = max(entry.flushed, lo, first if first >= 0 else hi)
            stop = min(int(end), hi)
            if entry.blocks is None:  # the same for every stretch of the request
                entry.blocks = self._sink_tensors(entry, lo, hi)
            stretch = Stretch(entry.req_id, entry.blocks)
            if stop > start:
                wanted = entry.wanted
                key = (entry.lanes, stop - start, wanted["dtype"],
                       repr(wanted.get("project")))
                groups.setdefault(key, []).append((entry, start, stretch))
            entry.flushed = max(entry.flushed, stop)
            if entry.slot is not None:
                self._slot_flushed[entry.slot] = entry.flushed
            if final:
                stretch.final = True
                stretch.line = self._sink_line(entry, first, lo, hi)
                positions = torch.arange(lo, hi, dtype=torch.int64).view(torch.uint8)
                stretch.pieces.append(("positions", positions, 0, positions.numel(), 0))
            by_sink.setdefault(entry.sink, []).append(stretch)
        for (lane_ids, n, dtype, _), items in groups.items():
            sites = [self._lane_site[lane] for lane in lane_ids]
            mine = [i for i, site in enumerate(sites) if site in self.installed]
            starts = np.array([entry.start + start for entry, start, _ in items])
            index = torch.as_tensor(starts[:, None] + np.arange(n), device=self.capture.device)
            lanes = self._lane_index([lane_ids[i] for i in mine])
            rows = self.capture[lanes[None, :, None], index[:, None, :]]  # [items, sites, n, H]
            data, _, width = encode(rows, dtype, items[0][0].wanted.get("project"))
            size = n * width * _STORED[dtype].itemsize
            for i, (entry, start, stretch) in enumerate(items):
                into = (start - entry.span[0]) * width * _STORED[dtype].itemsize
                for j, site_i in enumerate(mine):
                    stretch.pieces.append((site_name(sites[site_i]), data,
                                           (i * len(mine) + j) * size, size, into))
        for sink, stretches in by_sink.items():
            self.sinks[sink].send(stretches)

    def _sink_tensors(self, entry: _Entry, lo: int, hi: int
                      ) -> dict[str, tuple[str, np.dtype, tuple[int, ...]]]:
        """The blocks a request's sink reserves: its positions, and its rows at this worker's
        sites."""
        wanted = entry.wanted
        project = wanted.get("project")
        width = int(project["k"]) if project else self.hidden_size
        dtype = wanted["dtype"]
        tensors = {"positions": ("positions", np.dtype("<i8"), (hi - lo,))}
        for lane in entry.lanes:
            site = self._lane_site[lane]
            if site in self.installed:
                name = site_name(site)
                tensors[name] = (f"{name}/{dtype}/{width}", _STORED[dtype], (hi - lo, width))
        return tensors

    def _sink_line(self, entry: _Entry, first: int, lo: int, hi: int) -> dict[str, Any]:
        """The index line of a request written as it ran (tensor keys for names)."""
        start = max(lo, first) if first >= 0 else hi
        stop = max(start, min(entry.end, hi))
        rows = {"start": start - lo, "stop": stop - lo}
        status, detail = "ok", ""
        if start > lo and first >= 0:
            status = "partial"
            detail = (f"positions {lo}..{start - 1} were not computed by this request "
                      "(taken from the prefix cache)")
        return {"request_id": caller_id(entry.req_id), "meta": entry.wanted.get("meta") or {},
                "status": status, "detail": detail, "dtype": entry.wanted["dtype"],
                "positions": {"tensor": "positions", **rows},
                "sites": {site_name(site): {"tensor": site_name(site), **rows}
                          for site in (self._lane_site[lane] for lane in entry.lanes)
                          if site in self.installed}}

    def _whole_to_sink(self, entry: _Entry) -> None:
        """A request not written as it ran: its rows as a collect would read them, at once."""
        answer, data = self._read(entry, entry.first, entry.end, None, 0, self.first_gated,
                                  True)
        assert answer is not None and entry.sink is not None
        if answer["status"] == "skipped":  # a gated capture whose gate never fired
            return
        positions = np.frombuffer(answer["positions"], "<i8")
        n, width, dtype = int(answer["rows"]), int(answer["hidden"]), answer["dtype"]
        stored = _STORED.get(dtype, np.dtype("i1"))
        tensors: dict[str, tuple[str, np.dtype, tuple[int, ...]]] = {}
        line: dict[str, Any] = {
            "request_id": caller_id(entry.req_id), "meta": entry.wanted.get("meta") or {},
            "status": answer["status"], "detail": answer["detail"], "dtype": dtype,
            "positions": None, "sites": {}}
        stretch = Stretch(entry.req_id, tensors, final=True, line=line)
        if len(positions):
            tensors["positions"] = ("positions", np.dtype("<i8"), (len(positions),))
            blob = torch.from_numpy(positions.copy()).view(torch.uint8)
            stretch.pieces.append(("positions", blob, 0, blob.numel(), 0))
            line["positions"] = {"tensor": "positions", "start": 0, "stop": len(positions)}
        size = n * width * stored.itemsize
        scales = np.frombuffer(answer["scales"], "<f4")
        for i, name in enumerate(answer["sites"]):
            tensors[name] = (f"{name}/{dtype}/{width}", stored, (n, width))
            line["sites"][name] = {"tensor": name, "start": 0, "stop": n}
            if data is not None:
                stretch.pieces.append((name, data, i * size, size, 0))
            if len(scales):
                key = name + "/scales"
                tensors[key] = (f"{name}/{dtype}/scales", np.dtype("<f4"), (n,))
                blob = torch.from_numpy(scales[i * n:(i + 1) * n].copy()).view(torch.uint8)
                stretch.pieces.append((key, blob, 0, blob.numel(), 0))
                line["sites"][name]["scales"] = key
        self.sinks[entry.sink].send([stretch])

    def flush_sinks(self) -> dict[str, dict[str, int]]:
        """Write what finished requests left, wait until the sinks wrote everything queued,
        and seal every shard whose requests are finished; each sink's counters."""
        self.finish_sinks()
        for sink in self.sinks.values():
            sink.flush()
        return self.sink_counters()

    def sink_counters(self) -> dict[str, dict[str, int]]:
        return {name: vars(sink.counters).copy() for name, sink in self.sinks.items()}

    def finish_sinks(self, folded: bool = True) -> None:
        """Write and free the requests of engine sinks that finished. A gated one needs the
        step that ran its last forward ``folded`` (to know whether its gate fired): until
        then it waits."""
        if not self._finishing:
            return
        finishing = self._finishing
        self._finishing = [] if folded else [e for e in finishing
                                             if e.wanted.get("when") == "gated"]
        finishing = [e for e in finishing if e not in self._finishing]
        spans = [e for e in finishing if e.span is not None and e.sink in self.sinks]
        if spans:
            self._to_sink(spans, np.array([e.end for e in spans]), final=True)
        for entry in finishing:
            if entry.span is None and entry.sink in self.sinks:
                self._whole_to_sink(entry)
            self._requests.pop(entry.req_id, None)
            self._remember(self._sunk, entry.req_id, str(entry.sink))
            self._release(entry.lanes)

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

    def detach(self, req_id: str, finished: bool = False) -> None:
        """The request left the batch: its tokens stop writing. Its rows wait for collect,
        or, when it ``finished`` and its capture names an engine sink, for
        :meth:`finish_sinks`."""
        entry = self._requests.get(req_id)
        if entry is not None and entry not in self._finishing:
            self._detach(entry)
            if finished and entry.sink is not None:
                self._finishing.append(entry)
            else:
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
        before = self._slot_end[mine]
        self._slot_first[mine] = np.minimum(self._slot_first[mine], first)
        self._slot_end[mine] = np.maximum(
            before, np.minimum(first + num_scheduled[captured], self._slot_len[mine]))
        if self._sinking:
            due = before - self._slot_flushed[mine] >= FLUSH_ROWS
            if due.any():  # rows computed by the steps before this one, in stretches
                self._to_sink([self._by_slot[slot] for slot in mine[due].tolist()],
                              before[due], final=False)
            length = self._slot_len[mine]
            done = self._slot_sink[mine] & (before < length) & (self._slot_end[mine] >= length)
            if done.any():  # finished once this step's forward ran (see after_forward)
                self._completing += [self._by_slot[slot] for slot in mine[done].tolist()]

    def after_forward(self) -> None:
        """The step's forward is queued: requests of engine sinks that computed their last
        row in it (they reached ``max_tokens``) are written and freed without waiting for the
        engine to say they finished, which it does only with a later step. A gated one waits
        for its gate to be folded (:meth:`finish_sinks`)."""
        if not self._completing:
            return
        completing, self._completing = self._completing, []
        for entry in completing:
            if self._requests.get(entry.req_id) is entry:
                self._detach(entry)
                self._finishing.append(entry)
        self.finish_sinks(folded=False)

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
        entry = _Entry(req_id=req_id, start=start, length=rows, prompt_len=prompt_len,
                       lanes=lanes, wanted=wanted, sink=wanted.get("sink"))
        if entry.sink in self.sinks and _as_it_runs(wanted):
            selected = select(wanted["positions"], prompt_len, rows)
            if len(selected) and selected[-1] - selected[0] + 1 == len(selected):
                entry.span = (int(selected[0]), int(selected[-1]) + 1)
                entry.flushed = entry.span[0]
        return entry

    def _nothing(self, status: str, detail: str) -> dict[str, Any]:
        return {"status": status, "detail": detail, "sites": [], "hidden": self.hidden_size,
                "dtype": "float32", "positions": b"", "data": b"", "scales": b""}

    def _drop(self, req_id: str, why: str) -> None:
        logger.warning("dynsteer: request %s runs uncaptured: %s", req_id, why)
        self._remember(self._gone, req_id, why)
        return None

    @staticmethod
    def _remember(memory: OrderedDict[str, str], req_id: str, what: str) -> None:
        memory[req_id] = what
        while len(memory) > GONE:
            memory.popitem(last=False)

    @staticmethod
    def _find(requests: dict[str, Any], request_id: str) -> str | None:
        """The key of ``requests`` that is ``request_id`` or the engine's id of it."""
        if request_id in requests:
            return request_id
        matches = [r for r in requests if is_internal_id_of(r, request_id)]
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
            self._slot_flushed = np.concatenate([self._slot_flushed,
                                                 np.full(grow, _NO_SINK, np.int64)])
            self._slot_sink = np.concatenate([self._slot_sink, np.zeros(grow, bool)])
        entry.slot = slot
        self._slot_start[slot] = entry.start
        self._slot_len[slot] = entry.length
        self._slot_first[slot] = entry.first if entry.first >= 0 else _UNSEEN
        self._slot_end[slot] = entry.end
        self._by_slot[slot] = entry
        if entry.sink is not None:
            self._slot_sink[slot] = True
            self._sinking += 1
        if entry.span is not None:
            self._slot_flushed[slot] = entry.flushed

    def _detach(self, entry: _Entry) -> None:
        slot = entry.slot
        if slot is None:
            return
        entry.first, entry.end = self._seen(entry)
        self._slot_start[slot] = self._slot_len[slot] = self._slot_end[slot] = 0
        self._slot_first[slot] = _UNSEEN
        self._by_slot.pop(slot, None)
        entry.slot = None
        if entry.sink is not None:
            self._slot_sink[slot] = False
            self._sinking -= 1
        self._slot_flushed[slot] = _NO_SINK


def _as_it_runs(wanted: dict[str, Any]) -> bool:
    """Whether a request's rows can go to its sink as they are computed: each row is stored
    as it is (no gate decides at the end, no mean over positions, no per-row int8 scale read
    back to the host)."""
    return (wanted.get("when") != "gated" and wanted.get("reduce") is None
            and wanted["dtype"] in _STORED)
