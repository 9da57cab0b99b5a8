"""Worker-side steering state: the coordinator of one worker's steering data plane.

Every worker (every TP rank) holds one :class:`SteeringState` and receives the same control
calls and the same scheduler output, so rows are allocated identically on every rank. The jobs
live in their own modules: the registry of named vectors and probes by generation
(:mod:`.registry`), global steering (:mod:`.global_steering`), the resolution of a request's
wire spec into row contents (:mod:`.resolve`, pure numpy), the per-slot rows (:mod:`.slots`)
and the per-step token index (:mod:`.step_index`). This module admits and releases requests
through them and hands the site ops their buffers.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from dynsteer.controller.contract import Site, site_name
from dynsteer.controller.controllers import Action
from dynsteer.controller.extra_args import WIRE_KEY
from dynsteer.controller.wire import RawEntry

from . import gate_stats
from .buffers import SteerBuffers
from .capture_buffers import CaptureBuffers
from .control import ControlTable
from .controllers import ControllerRunner
from .events import EngineEvents
from .global_steering import GlobalSteerings
from .host_time import HostTime
from .layout import GATE, SCORE
from .position_rows import positioned, stretches
from .registry import Registry
from .resolve import UNSTEERED, switched
from .rows import ProbeTable, RowTable
from .sites import SiteBuffers
from .slots import Admitted, SlotTable
from .step_index import StepIndex
from .step_upload import StepUpload
from .telemetry import GateTelemetry
from .token_rows import DeviceFill, TokenRows, fill_layout

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])


class SteeringState:
    """Everything one worker needs to steer: tables, token index, registry, requests."""

    def __init__(
        self,
        sites: tuple[Site, ...],
        hidden_size: int,
        max_rows: int,
        max_tokens: int,
        max_slots: int,
        device: torch.device,
        capture_lanes: int = 0,
        capture_tokens: int = 1,
        block_size: int = 16,
        max_gates: int | None = None,
        monitor_sites: frozenset[Site] | None = None,
        max_projections: int = 0,
        site_groups: bool = True,
    ) -> None:
        self.sites = sites
        self.monitor_sites = frozenset(sites) if monitor_sites is None else monitor_sites
        """Sites whose op monitors and captures (None: every site)."""
        self.hidden_size = hidden_size
        self.rows = RowTable(sites, hidden_size, max_rows, device, max_projections, site_groups)
        self.probe_table = ProbeTable(sites, hidden_size, max_gates or max_rows, device)
        self.token_rows = TokenRows(max_tokens, device)
        self.gate_score = torch.zeros(2, max_tokens, dtype=torch.float32, device=device)
        """Per-token gate (row ``GATE``, written at each token's monitor site) and probe score
        (row ``SCORE``) of the step: one buffer, so the read-back is one copy."""
        self.gate, self.score = self.gate_score[GATE], self.gate_score[SCORE]
        self.control = ControlTable(max_slots, self.token_rows.buffer, self.gate_score)
        """Per-request controller state the monitor applies (see :mod:`.control`)."""
        self.uploads = StepUpload({**fill_layout(max_slots, max_slots),
                                   **gate_stats.ops_layout(max_slots)}, device)
        """The device fill's and the gate statistics' host-written buffers, one copy a step
        (see :mod:`.step_upload`)."""
        self.telemetry = GateTelemetry(self.gate_score, self.token_rows.buffer,
                                       [site_name(s) for s in sites], block_size, max_slots,
                                       control=self.control.table, upload=self.uploads)
        """Gate counters and the prefix-guard report; ``block_size`` is the KV block size."""
        self.controllers = ControllerRunner(self.control, self.telemetry, self._switch)
        """Controllers of gated requests (see :mod:`.controllers`)."""
        self.telemetry.observer = self.controllers.observe
        self.events: EngineEvents | None = None
        """Controller events (this worker publishes them: see :meth:`set_events`)."""
        self.host_time = HostTime()
        """Host time of the runner hooks (attached by :mod:`.attach`)."""
        self.capture = CaptureBuffers(sites, capture_lanes, capture_tokens, hidden_size,
                                      max_slots, device, self.monitor_sites)
        """Activation capture for probe training (off, and no memory, with 0 lanes)."""
        self.capture.first_gated = self._first_gated
        self.registry = Registry(hidden_size, self.monitor_sites)
        self.globals = GlobalSteerings()
        self.slots = SlotTable(max_slots, self.rows, self.probe_table)
        self.index = StepIndex(self.slots, self.rows, self.token_rows, self.telemetry,
                               self.control, self.controllers, self.capture, self.uploads)
        self._requests: dict[str, Admitted] = {}
        self.requests_steered = 0
        """Requests admitted with a nonzero row (counter)."""

    # ---- control plane -------------------------------------------------------------------
    # Named vectors and probes change through :attr:`registry` (generations: see
    # :mod:`.registry`); requests admitted earlier keep what they were admitted with.
    def set_global(self, entries: list[RawEntry], key: str) -> None:
        """Replace global steering (resolved entries, see :mod:`dynsteer.controller.wire`)
        for requests admitted from now on, which carry ``key``; live requests keep the one
        they were admitted under (their prefix-cache key names it)."""
        self.globals.set(entries, key, self.registry.vectors, self.hidden_size)

    def set_events(self, events: EngineEvents) -> None:
        """Publish request and monitor events (see :mod:`.events`)."""
        self.events = events
        self.telemetry.events = events
        self.index.forget_batch()  # steps now hand their gated tokens over

    # ---- request lifecycle ---------------------------------------------------------------
    def add_request(self, req_id: str, slot: int, extra_args: Any, prompt_len: int) -> None:
        """Admit a request: build its rows from the resolved spec the frontend wrote (see
        :mod:`dynsteer.controller.wire`: bytes and numbers, no parsing here).

        Specs were validated by the frontend; if one still cannot be served (a vector name
        removed in between, no free row) the request runs unsteered and a warning is logged:
        a step must never fail because of one request.
        """
        self.remove_request(req_id)
        self.index.forget_batch()
        wire = extra_args.get(WIRE_KEY) if isinstance(extra_args, dict) else None
        generation = self.registry.generation_of(req_id, extra_args)
        resolved, key, parts = UNSTEERED, "-", None
        if wire is not None:
            try:
                resolved, key = self.registry.resolve(wire, generation), wire["key"]
                if positioned(wire):
                    parts = stretches(wire, prompt_len,
                                      lambda w: self.registry.resolve(w, generation))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                logger.warning("dynsteer: request %s runs unsteered: %s", req_id, e)
                resolved, key, parts = UNSTEERED, "-", None
        probe = resolved.probe
        req = Admitted(slot=slot, resolved=resolved, key=key,
                       wire=wire if resolved is not UNSTEERED else None,
                       global_key=self.globals.hold(req_id, extra_args), generation=generation,
                       stretches=parts)
        self.slots.place(slot, prompt_len)
        self._requests[req_id] = req
        self.slots.assign(req, self.globals[req.global_key])
        self.capture.admit(req_id, slot, extra_args, prompt_len)
        if self.slots.steers(slot):
            self.requests_steered += 1
        if self.events is not None:
            self.events.request_started(req_id, req.wire)
        if probe is not None:
            dynamic_from = (0 if resolved.dynamic("prefill") else
                            prompt_len if resolved.dynamic("decode") else None)
            self.telemetry.admit(req_id, slot, prompt_len, site=site_name(probe.site),
                                 dynamic_from=dynamic_from, trace=resolved.trace,
                                 session=req.wire.get("session") if req.wire else None)
            controller = req.wire.get("controller") if req.wire else None
            if controller is not None and self.slots.probe_row[slot]:
                req.control_row = self.controllers.admit(
                    req_id, slot, self.telemetry.record_of_slot(slot), controller["name"],
                    controller["params"], req.wire.get("session"), prompt_len)
                self.slots.control_row[slot] = req.control_row

    def remove_request(self, req_id: str, finished: bool = False) -> None:
        """Release a request's rows: it ``finished``, or it left the batch to come back
        (capture rows wait for collect, or for its sink)."""
        self.capture.detach(req_id, finished)
        self.index.forget_batch()
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        self.slots.release(req)
        self.globals.release(req.global_key)
        if req.control_row:
            self.controllers.finish(req_id, self.telemetry.record_of_slot(req.slot),
                                    req.control_row)
            self.slots.control_row[req.slot] = 0
        self.telemetry.finish(req_id)  # publishes the finished event of a gated request
        if self.events is not None and req.resolved.probe is None:
            self.events.request_finished(req_id, (req.wire or {}).get("session"), None)

    def after_updates(self, empty: bool) -> None:
        """A step's removals and admissions are done. A step that schedules nothing only
        tells the workers which requests finished, and the engine may go idle after it: their
        counters are read out now (the GPU has nothing else queued), so their finished events
        go out without waiting for a next step."""
        if empty:
            self.telemetry.drain()
            self.capture.finish_sinks()

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def any_steered(self) -> bool:
        """Whether any live request uses a nonzero row."""
        return self.slots.num_steered > 0

    @property
    def needs_fill(self) -> bool:
        """Whether the step's token index must be filled (something is steered or captured)."""
        return self.slots.num_steered > 0 or self.capture.active

    def _switch(self, req_id: str, action: Action, name: str | None) -> None:
        """A controller's switch (see :func:`.resolve.switched`). KV from here on is computed
        under steering the request's cache key does not describe, so the prefix guard stops
        sharing it here."""
        req = self._requests[req_id]
        wire = switched(req.wire or {}, req.key, action, name, self.registry.vectors,
                         self.registry.probes)
        resolved = self.registry.resolve(wire, self.registry.current)
        parts = None
        if positioned(wire):
            parts = stretches(wire, int(self.slots.prompt_len[req.slot]),
                              lambda w: self.registry.resolve(w, self.registry.current))
        self.slots.release(req)
        req.resolved, req.wire, req.key, req.stretches = resolved, wire, wire["key"], parts
        req.generation = self.registry.current
        self.slots.assign(req, self.globals[req.global_key])
        record = self.telemetry.record_of_slot(req.slot)
        self.telemetry.mark_dynamic(req.slot, self.telemetry.processed(record))

    # ---- per step (see :mod:`.step_index`) ------------------------------------------------
    @property
    def device_fill(self) -> DeviceFill | None:
        return self.index.device_fill

    @property
    def index_fills(self) -> dict[str, int]:
        """Steps whose index the device filled, the host filled, and the device kept."""
        return self.index.fills

    def enable_device_fill(self, query_start_loc: torch.Tensor, positions: torch.Tensor
                           ) -> None:
        self.index.enable_device_fill(query_start_loc, positions)

    def fill(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray,
             device_slots: torch.Tensor | None = None) -> None:
        # Finished captures first: a gated one reads its gate decision, which folds the steps
        # run so far, and must not read back this step's values before its forward runs.
        self.capture.finish_sinks()
        self.index.fill(slots, num_computed, num_scheduled, device_slots)

    def skip_step(self) -> None:
        self.capture.finish_sinks()
        self.index.skip()

    def after_forward(self) -> dict[str, tuple[int, int | None]]:
        """A step's forward is queued: requests of engine sinks that computed their last row
        are written now (see :meth:`.CaptureBuffers.after_forward`); returns the prefix-guard
        report of gated requests (see :mod:`.prefix_guard`)."""
        self.capture.after_forward()
        return self.telemetry.cache_report()

    def flush_capture_sinks(self) -> dict[str, dict[str, int]]:
        """Fold every step (a gated capture knows whether its gate fired), then flush the
        engine's capture sinks (see :meth:`.CaptureBuffers.flush_sinks`)."""
        self.telemetry.drain()
        return self.capture.flush_sinks()

    def collect_activations(self, requests: list[tuple[str, int | None, int]], reply: bool,
                            inbox: dict[str, str] | None, keep: bool = False
                            ) -> dict[str, Any] | None:
        """Requests' own captured rows (see :meth:`.CaptureBuffers.collect_requests`)."""
        return self.capture.collect_requests(requests, reply, self._first_gated, inbox, keep)

    def _first_gated(self, req_id: str) -> int | None:
        """The first position whose gate fired (None: none, or no gate)."""
        report = self.telemetry.report(req_id)
        return None if report is None else report["first_gated"]

    def site_buffers(self) -> dict[Site, SiteBuffers]:
        """The buffer views each site's op reads."""
        out = {}
        for site in self.sites:
            i = self.rows.site_index(site)
            out[site] = SiteBuffers(position=i, monitor=site in self.monitor_sites,
                                    site_bit=self.rows.site_bit(i),
                                    buffers=SteerBuffers(
                index=self.token_rows.buffer, gate_score=self.gate_score,
                table=self.rows.table[i], dyn=self.rows.dyn[i], flags=self.rows.flags[i],
                probes=self.probe_table.probes, params=self.probe_table.params,
                capture=self.capture.capture, site_lane=self.capture.site_lane,
                control=self.control.table, proj_dir=self.rows.proj_dir[i],
                proj_par=self.rows.proj_par[i], proj_gram=self.rows.proj_gram[i],
            ))
        return out

    def info(self) -> dict[str, Any]:
        """Counters for tests, metrics and the info RPC (after folding every step, so ranks
        that ran the same steps report the same controller checksum)."""
        self.telemetry.drain()
        return {
            **self.controllers.info(),
            **(self.events.publisher.stats() if self.events is not None else {}),
            "sites": [site_name(s) for s in self.sites],
            "monitor_sites": [site_name(s) for s in self.sites if s in self.monitor_sites],
            "rows_in_use": self.rows.in_use,
            "rows_rejected": self.rows.rejected,
            "max_rows": self.rows.max_rows,
            "live_requests": len(self._requests),
            "steered_requests_live": self.slots.num_steered,
            "requests_steered_total": self.requests_steered,
            "probe_rows_in_use": self.probe_table.in_use,
            "vectors": sorted(self.registry.vectors),
            "probes": sorted(self.registry.probes),
            "global_entries": len(self.globals[self.globals.current].entries),
            "global_steerings_held": len(self.globals),
            "registry_generation": self.registry.current,
            "capture_rows_in_use": self.capture.rows_in_use,
            "capture_sinks": self.capture.sink_counters(),
            "tokens_monitored": dict(self.telemetry.tokens_monitored),
            "tokens_gated": dict(self.telemetry.tokens_gated),
            "host_time": self.host_time.summary(),
            "index_fills": dict(self.index_fills),
        }
