"""Worker-side steering state: named vectors, global steering and per-request rows.

Every worker (every TP rank) holds one :class:`SteeringState` and receives the same control
calls and the same scheduler output, so rows are allocated identically on every rank.

Requests are tracked by *slot*: a small integer the runner adapter chooses (the V2 runner's own
request slot, or one the V1 adapter allocates). Per-slot numpy arrays make the per-step index
fill a vectorized gather.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dynsteer.controller.contract import Site, site_name
from dynsteer.controller.controllers import Action
from dynsteer.controller.extra_args import GLOBAL_KEY, REGISTRY_KEY, WIRE_KEY
from dynsteer.controller.wire import F32, RawEntry, WireProbe, read_entries

from . import gate_stats
from .buffers import SteerBuffers
from .capture_buffers import CaptureBuffers
from .control import ControlTable
from .controllers import ControllerRunner
from .events import EngineEvents
from .host_time import HostTime
from .layout import GATE, POS_ABSOLUTE, SCORE
from .rows import (
    Contents,
    ProbeRow,
    ProbeTable,
    Projection,
    Projections,
    RowTable,
    add_contents,
    add_projections,
)
from .sites import SiteBuffers
from .step_upload import StepUpload
from .telemetry import GateTelemetry
from .token_rows import DeviceFill, TokenRows, fill_layout, per_token

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

PHASES: tuple[Literal["prefill"], Literal["decode"]] = ("prefill", "decode")


NO_GLOBAL = "-"
"""Key of "no global steering"."""
GLOBAL_HISTORY = 16
"""Global steerings a worker keeps after they were replaced, beyond those live requests
hold: a request admitted just before a change may reach the workers after it."""


REGISTRY_HISTORY = 64
"""Registry generations a worker keeps after later changes replaced them: a request the
frontend admitted under one (its extra args name it) may be scheduled after a vector or probe
it names was replaced or deleted, and must still be steered with what it was admitted with."""


@dataclass(frozen=True)
class _Registry:
    """The named vectors and probes of one registry generation (never changed in place: a
    change makes a new generation, so older ones stay what they were)."""

    vectors: dict[str, np.ndarray]
    probes: dict[str, WireProbe]
    """Probes in their resolved form (the site comes from each request's gate)."""


@dataclass(frozen=True)
class _Global:
    """One global steering, resolved: what a row adds to a request's own steering."""

    entries: list[RawEntry]
    adds: dict[str, Contents]
    projections: dict[str, Projections]


@dataclass
class _Request:
    slot: int
    own: dict[str, Contents]
    """This request's own static steering per phase (global steering excluded)."""
    gated: dict[str, Contents]
    """This request's gated steering per phase."""
    projections: dict[str, Projections]
    """This request's ablate / clamp entries per phase (own, then gated)."""
    probe: ProbeRow | None
    wire: dict[str, Any] | None = None
    """The resolved spec (None: unsteered)."""
    control_row: int = 0
    """The request's controller row (0: no controller)."""
    key: str = "-"
    """What determines the request's rows besides global steering and the registry: the
    resolved spec's content hash ("-": no spec; "-nogate" suffix when the gate could not get a
    probe row)."""
    global_key: str = NO_GLOBAL
    """The global steering the request was admitted under (it keeps it to the end)."""
    generation: int = 0
    """The registry generation its named vectors and probes resolve in (part of its row
    keys)."""


@dataclass
class _Kept:
    """The decode batch whose index the device fill holds (see :meth:`SteeringState._keeps`):
    the bytes a next step of it carries (its slots and the slot table's version are checked
    against the key the index holds, :meth:`.TokenRows.holds`)."""

    ones: bytes
    """``num_scheduled`` of a step of one decode token per request."""
    end: bytes
    """``num_computed`` of a step continuing where this one ended."""
    any_gated: bool


@dataclass(frozen=True)
class _Resolved:
    """What a resolved spec builds (the same for every request that carries it)."""

    own: dict[str, Contents]
    gated: dict[str, Contents]
    projections: dict[str, Projections]
    probe: ProbeRow | None
    trace: bool

    def dynamic(self, phase: str) -> bool:
        """Whether tokens of ``phase`` are steered by the gate (gated adds or projections)."""
        return bool(self.gated[phase]) or any(
            p.gated for items in self.projections[phase].values() for p in items)


_UNSTEERED = _Resolved(own={p: {} for p in PHASES}, gated={p: {} for p in PHASES},
                       projections={p: {} for p in PHASES}, probe=None, trace=False)

RESOLVED_SPECS = 256
"""Distinct resolved specs a worker keeps built (a bounded LRU; identical specs reuse them)."""


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
        self.device_fill: DeviceFill | None = None
        """The index filled on the device, where the runner keeps its batch there (see
        :meth:`enable_device_fill`)."""
        self.index_fills = {"device": 0, "host": 0, "kept": 0}
        """Steps whose index the device filled, those the host filled, and those whose index
        the device path kept from the step before (the same decode batch, each request
        continuing where its last step ended)."""
        self._kept: _Kept | None = None
        """The steady decode batch the index holds, while no request was admitted or removed
        since (see :meth:`_keeps`)."""
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
        self._registries: OrderedDict[int, _Registry] = OrderedDict({0: _Registry({}, {})})
        """Registry generations, oldest first: the current one (last) and the
        :data:`REGISTRY_HISTORY` before it."""
        self._generation = 0
        self._globals: OrderedDict[str, _Global] = OrderedDict(
            {NO_GLOBAL: _Global([], {p: {} for p in PHASES}, {p: {} for p in PHASES})})
        """Global steerings by key, least recently set or released first: the current one,
        those live requests were admitted under (refcounted in ``_global_users``) and the
        :data:`GLOBAL_HISTORY` last others."""
        self._global_users: dict[str, int] = {}
        self._current_global = NO_GLOBAL
        self._requests: dict[str, _Request] = {}
        self._prefill_row = np.zeros(max_slots, dtype=np.int32)
        self._decode_row = np.zeros(max_slots, dtype=np.int32)
        self._prompt_len = np.zeros(max_slots, dtype=np.int64)
        self._probe_row = np.zeros(max_slots, dtype=np.int32)
        self._control_row = np.zeros(max_slots, dtype=np.int32)
        self._next_pos = np.full(max_slots, -1, dtype=np.int64)
        """Where each slot's request's last step ended (-1: no step yet)."""
        self._slots_version = 0
        """Counts the changes of the per-slot rows and prompt lengths that the device fill's
        slot table must follow: a steered request's admission and release. An unsteered one
        changes nothing there (its slot's rows are zero since the last occupant's release, and
        with both rows zero its prompt length picks nothing), so half of the serving mix's
        admissions and finishes upload no table."""
        self._num_steered = 0
        self.requests_steered = 0
        """Requests admitted with a nonzero row (counter)."""
        self._resolved: OrderedDict[tuple[str, int], _Resolved] = OrderedDict()

    # ---- control plane -------------------------------------------------------------------
    # ``generation``: the registry generation the change creates, numbered by the frontend;
    # requests it admits from then on carry it (``REGISTRY_KEY``).
    @property
    def vectors(self) -> dict[str, np.ndarray]:
        """Registered vectors (current generation)."""
        return self._registries[self._generation].vectors

    @property
    def probes(self) -> dict[str, WireProbe]:
        """Registered probes (current generation)."""
        return self._registries[self._generation].probes

    def register_vector(self, name: str, data: bytes, generation: int) -> None:
        """Add or replace a named vector, given as the little-endian float32 bytes the frontend
        checked (requests admitted earlier keep the old values)."""
        self._change(generation, vectors={**self.vectors, name: np.frombuffer(data, dtype=F32)})

    def unregister_vector(self, name: str, generation: int) -> None:
        """Remove a named vector; unknown names raise ``KeyError``."""
        self._change(generation, vectors=_without(self.vectors, name))

    def register_probe(self, name: str, probe: WireProbe, generation: int) -> None:
        """Add or replace a named probe, given in the resolved form the frontend checked
        (``[weights bytes, threshold, sharpness]``); requests admitted earlier keep the old
        one."""
        self._change(generation, probes={**self.probes, name: probe})

    def update_probe(self, name: str, threshold: float, sharpness: float | None,
                     generation: int) -> None:
        """A registered probe's new threshold (and sharpness); unknown names raise KeyError."""
        weights, _, old_sharpness = self.probes[name]
        self._change(generation, probes={**self.probes, name: [
            weights, threshold, old_sharpness if sharpness is None else sharpness]})

    def unregister_probe(self, name: str, generation: int) -> None:
        """Remove a named probe; unknown names raise ``KeyError``."""
        self._change(generation, probes=_without(self.probes, name))

    def _change(self, generation: int, vectors: dict[str, np.ndarray] | None = None,
                probes: dict[str, WireProbe] | None = None) -> None:
        """Make ``generation`` the current registry, keeping the older ones (bounded)."""
        current = self._registries[self._generation]
        self._registries[generation] = _Registry(
            current.vectors if vectors is None else vectors,
            current.probes if probes is None else probes)
        self._registries.move_to_end(generation)
        self._generation = generation
        while len(self._registries) > REGISTRY_HISTORY + 1:
            self._registries.popitem(last=False)

    def _generation_of(self, req_id: str, extra_args: Any) -> int:
        """The registry generation a request was admitted under (the frontend wrote it)."""
        generation = (extra_args.get(REGISTRY_KEY, self._generation)
                      if isinstance(extra_args, dict) else self._generation)
        if generation not in self._registries:
            logger.warning("dynsteer: request %s was admitted under a registry changed more "
                           "than %d times since; its names resolve in the current one",
                           req_id, REGISTRY_HISTORY)
            generation = self._generation
        return generation

    def set_global(self, entries: list[RawEntry], key: str) -> None:
        """Replace global steering (resolved entries, see :mod:`dynsteer.controller.wire`)
        for requests admitted from now on, which carry ``key``; live requests keep the one
        they were admitted under (their prefix-cache key names it)."""
        key = key if entries else NO_GLOBAL
        self._globals[key] = _Global(entries, *self._contents(entries, self.vectors))
        self._globals.move_to_end(key)
        self._current_global = key
        self._forget_globals()

    def _forget_globals(self) -> None:
        """Drop replaced global steerings no live request holds, beyond the history."""
        spare = [k for k in self._globals if k not in (NO_GLOBAL, self._current_global)
                 and k not in self._global_users]
        for key in spare[:max(0, len(spare) - GLOBAL_HISTORY)]:
            del self._globals[key]

    def _global_of(self, req_id: str, extra_args: Any) -> str:
        """The global steering a request was admitted under (the frontend wrote its key)."""
        key = extra_args.get(GLOBAL_KEY, NO_GLOBAL) if isinstance(extra_args, dict) else NO_GLOBAL
        if key not in self._globals:
            logger.warning("dynsteer: request %s was admitted under a global steering replaced "
                           "more than %d times since; it runs under the current one",
                           req_id, GLOBAL_HISTORY)
            key = self._current_global
        self._global_users[key] = self._global_users.get(key, 0) + 1
        return key

    def set_events(self, events: EngineEvents) -> None:
        """Publish request and monitor events (see :mod:`.events`)."""
        self.events = events
        self.telemetry.events = events
        self._kept = None  # steps now hand their gated tokens over (not a kept step's path)

    # ---- request lifecycle ---------------------------------------------------------------
    def add_request(self, req_id: str, slot: int, extra_args: Any, prompt_len: int) -> None:
        """Admit a request: build its rows from the resolved spec the frontend wrote (see
        :mod:`dynsteer.controller.wire`: bytes and numbers, no parsing here).

        Specs were validated by the frontend; if one still cannot be served (a vector name
        removed in between, no free row) the request runs unsteered and a warning is logged:
        a step must never fail because of one request.
        """
        self.remove_request(req_id)
        self._kept = None
        wire = extra_args.get(WIRE_KEY) if isinstance(extra_args, dict) else None
        generation = self._generation_of(req_id, extra_args)
        resolved, key = _UNSTEERED, "-"
        if wire is not None:
            try:
                resolved, key = self._resolve(wire, generation), wire["key"]
            except (ValueError, KeyError, TypeError, IndexError) as e:
                logger.warning("dynsteer: request %s runs unsteered: %s", req_id, e)
        probe = resolved.probe
        req = _Request(slot=slot, own=resolved.own, gated=resolved.gated,
                       projections=resolved.projections, probe=probe, key=key,
                       wire=wire if resolved is not _UNSTEERED else None,
                       global_key=self._global_of(req_id, extra_args), generation=generation)
        self._ensure_slot(slot)
        self._requests[req_id] = req
        self._prompt_len[slot] = prompt_len  # the slot table follows only if it steers (_assign)
        self._next_pos[slot] = -1
        self._assign(req)
        self.capture.admit(req_id, slot, extra_args, prompt_len)
        if self._steers(slot):
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
            if controller is not None and self._probe_row[slot]:
                req.control_row = self.controllers.admit(
                    req_id, slot, self.telemetry.record_of_slot(slot), controller["name"],
                    controller["params"], req.wire.get("session"), prompt_len)
                self._control_row[slot] = req.control_row

    def remove_request(self, req_id: str) -> None:
        """Release a finished (or re-added) request's rows (capture rows wait for collect)."""
        self.capture.detach(req_id)
        self._kept = None
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._release(req)
            users = self._global_users[req.global_key] - 1
            if users:
                self._global_users[req.global_key] = users
            else:
                del self._global_users[req.global_key]
                self._globals.move_to_end(req.global_key)
                self._forget_globals()
            if req.control_row:
                self.controllers.finish(req_id, self.telemetry.record_of_slot(req.slot),
                                        req.control_row)
                self._control_row[req.slot] = 0
            self.telemetry.finish(req_id)  # publishes the finished event of a gated request
            if self.events is not None and req.probe is None:
                self.events.request_finished(req_id, (req.wire or {}).get("session"), None)

    def after_updates(self, empty: bool) -> None:
        """A step's removals and admissions are done. A step that schedules nothing only
        tells the workers which requests finished, and the engine may go idle after it: their
        counters are read out now (the GPU has nothing else queued), so their finished events
        go out without waiting for a next step."""
        if empty:
            self.telemetry.drain()

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def any_steered(self) -> bool:
        """Whether any live request uses a nonzero row."""
        return self._num_steered > 0

    @property
    def needs_fill(self) -> bool:
        """Whether the step's token index must be filled (something is steered or captured)."""
        return self._num_steered > 0 or self.capture.active

    # ---- per step ------------------------------------------------------------------------
    def enable_device_fill(self, query_start_loc: torch.Tensor, positions: torch.Tensor
                           ) -> None:
        """Let the device fill the index from the runner's persistent buffers of each step's
        batch (see :class:`.token_rows.DeviceFill`); steps then pass their batch's slots as a
        device tensor to :meth:`fill`."""
        self.device_fill = DeviceFill(self.token_rows, len(self._prefill_row), query_start_loc,
                                      positions, self.uploads)

    def fill(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray,
             device_slots: torch.Tensor | None = None) -> None:
        """Fill the token index for one step; arrays are per request in batch order.

        Whole-array work only (no Python per request or per token): the step's host cost does
        not grow with the number of requests beyond numpy's vectorized passes.
        ``device_slots``: ``slots`` on the device, given where the runner has them and its
        persistent buffers hold the step's batch (see :meth:`enable_device_fill`); then,
        unless a token needs host work of its own (capture, a controller, gate traces), the
        device fills the index. It reads the host's ``slots``, sent with the step's other
        uploads in one copy (:mod:`.step_upload`), not this tensor, which vLLM allocates
        anew each step.

        Order matters: the previous step's copies are launched first (the controller table
        as it was during that step), then Python controllers act (they may switch rows), the
        step is registered, the built-in controllers fold the previous step (on the stream,
        before the index is refilled) and last the index is filled."""
        self.telemetry.launch_copy()
        self.controllers.before_step(self.telemetry.steps)
        if device_slots is not None and self._keeps(slots, num_computed, num_scheduled):
            return
        probe_rows = self._probe_row[slots]
        gated = probe_rows != 0
        any_gated = np.count_nonzero(gated) > 0  # the cheap forms: see token_rows' docstring
        counts = num_scheduled.astype(np.int64, copy=False)
        capture_starts = self.capture.slot_starts(slots)
        control_rows = self._control_row[slots]
        controlled = np.count_nonzero(control_rows) > 0
        tokens = int(counts.sum())
        if (device_slots is not None and self.device_fill is not None
                and capture_starts is None and not controlled and not self.telemetry.wants_tokens
                and self.device_fill.table.fits(len(self._prefill_row))):
            filled = self._fill_on_device(slots, num_computed, num_scheduled, tokens,
                                          any_gated)
            self.index_fills["device" if filled else "kept"] += 1
            return
        self.index_fills["host"] += 1
        positions = pos_entries = None
        if any_gated:
            positions, pos_entries = self._gate_positions(slots, gated, num_computed, counts,
                                                          tokens, controlled)
        if positions is not None and (controlled or self.telemetry.wants_tokens):
            request = np.repeat(np.arange(len(counts)), counts)
            mine = gated[request]
            self.telemetry.before_step(
                tokens, True, np.flatnonzero(mine), np.asarray(slots)[request[mine]],
                positions[mine], np.repeat(control_rows, counts)[mine] if controlled else None)
        else:
            self.telemetry.before_step(tokens, any_gated)
        self.control.before_step(tokens)
        entries = self.rows.entries
        self.token_rows.fill(
            entries[self._prefill_row[slots]],
            entries[self._decode_row[slots]],
            probe_rows,
            self._prompt_len[slots],
            num_computed,
            counts,
            capture_starts,
            positions,
            control_rows,
            slots if any_gated else None,
            pos_entries,
            tokens,
        )
        if capture_starts is not None:
            self.capture.record(slots, capture_starts, num_computed, num_scheduled)

    def _fill_on_device(self, slots: np.ndarray, num_computed: np.ndarray,
                        num_scheduled: np.ndarray, tokens: int, any_gated: bool) -> bool:
        """:meth:`fill` by the device, from the slot table (uploaded if a slot changed).
        False: the index already held the step's (a decode step of the batch before: see
        :meth:`.TokenRows.fill_from_slots`), nothing was launched."""
        assert self.device_fill is not None
        self.telemetry.before_step(tokens, any_gated)
        self.control.before_step(tokens)
        version = (self._slots_version, self.rows.entries_version)
        self.device_fill.table.sync(version, self.rows.entries, self._prefill_row,
                                    self._decode_row, self._probe_row, self._prompt_len)
        steady = None  # one decode token each (rows: decode), each where its request ended
        if (tokens == len(slots)
                and not np.count_nonzero(num_computed < self._prompt_len[slots])
                and not np.count_nonzero(num_computed != self._next_pos[slots])):
            steady = (slots.tobytes(), version)
        self._next_pos[slots] = num_computed + num_scheduled  # where each request's step ends
        filled = self.token_rows.fill_from_slots(self.device_fill, slots, tokens, steady)
        self._kept = None if steady is None else _Kept(
            np.ones_like(num_scheduled).tobytes(), (num_computed + 1).tobytes(), any_gated)
        return filled

    def _keeps(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
               ) -> bool:
        """:meth:`fill`'s path for a decode step of the steady batch before (most steps of a
        serving engine): the same slots in the same order, one token each, each continuing
        where its last step ended, no request admitted or removed since (:attr:`_kept`), the
        slot table's version unchanged and the index still the one the device filled for it.
        Then nothing that :meth:`fill` reads can differ from that step's (capture, controller
        rows and token hand-overs change only with admissions, removals and
        :meth:`set_events`), so the index is kept after three byte comparisons, without
        :meth:`_fill_on_device`'s per-slot look-ups. False: take the full path."""
        kept = self._kept
        if (kept is None or num_scheduled.tobytes() != kept.ones
                or num_computed.tobytes() != kept.end
                or not self.token_rows.holds(
                    (slots.tobytes(), (self._slots_version, self.rows.entries_version)))):
            return False
        tokens = len(slots)
        self.telemetry.before_step(tokens, kept.any_gated)
        self.control.before_step(tokens)
        end = num_computed + 1
        self._next_pos[slots] = end
        kept.end = end.tobytes()
        self.index_fills["kept"] += 1
        return True

    def _gate_positions(self, slots: np.ndarray, gated: np.ndarray, num_computed: np.ndarray,
                        counts: np.ndarray, tokens: int, controlled: bool
                        ) -> tuple[np.ndarray | None, np.ndarray]:
        """The token positions (None where nothing needs them this step) and the index's
        position entries of a gated step: each token's offset from where its request's
        previous step ended, so a decode step's entries repeat (no upload), and the position
        itself (``POS_ABSOLUTE``) for requests that did not continue where they ended (just
        admitted, resumed, recomputed, or rejected speculative tokens). ``tokens``: the
        step's token count (the sum of ``counts``)."""
        one_each = tokens == len(counts)  # a decode step: every offset is 0
        if one_each:
            offsets = np.zeros(tokens, dtype=np.int64)
        else:
            starts = np.cumsum(counts) - counts
            offsets = np.arange(tokens) - np.repeat(starts, counts)
        moved = gated & (num_computed != self._next_pos[slots])
        any_moved = np.count_nonzero(moved) > 0
        self._next_pos[slots] = num_computed + counts
        positions = None
        if any_moved or controlled or self.telemetry.wants_tokens:
            positions = offsets + per_token(num_computed, counts, one_each)
        if any_moved:
            jumps = per_token(moved, counts, one_each)
            offsets[jumps] = positions[jumps] | POS_ABSOLUTE
        return positions, offsets

    def cache_report(self) -> dict[str, tuple[int, int | None]]:
        """The prefix-guard report of gated requests (see :mod:`.prefix_guard`)."""
        return self.telemetry.cache_report()

    def skip_step(self) -> None:
        """A step with nothing steered, or a forward no request is in (a data-parallel idle
        batch): fold the previous step (telemetry, controllers: against the index it ran
        with), then clear the index, so no token of this forward reads a request's rows,
        capture slots or controller rows."""
        self.telemetry.before_step(0, False)
        self.controllers.before_step(self.telemetry.steps)
        self.control.before_step(0)
        self.token_rows.clear()

    # ---- internals -----------------------------------------------------------------------
    def _resolve(self, wire: dict[str, Any], generation: int) -> _Resolved:
        """What a resolved spec builds with the named vectors and probes of registry
        ``generation``; identical specs (same key, same generation) reuse it."""
        cache_key = (wire["key"], generation)
        hit = self._resolved.get(cache_key)
        if hit is not None:
            self._resolved.move_to_end(cache_key)
            return hit
        gate, registry = wire["gate"], self._registries[generation]
        own, own_projections = self._contents(wire["steer"], registry.vectors)
        gated, gated_projections = (
            self._contents(gate["steer"], registry.vectors, gated=True) if gate is not None
            else (_UNSTEERED.gated, _UNSTEERED.projections))
        resolved = _Resolved(
            own=own, gated=gated,
            projections={p: add_projections(own_projections[p], gated_projections[p])
                         for p in PHASES},
            probe=self._resolve_probe(gate, registry.probes) if gate is not None else None,
            trace=bool(gate["trace"]) if gate is not None else False,
        )
        self._resolved[cache_key] = resolved
        while len(self._resolved) > RESOLVED_SPECS:
            self._resolved.popitem(last=False)
        return resolved

    def _resolve_probe(self, gate: dict[str, Any], probes: dict[str, WireProbe]) -> ProbeRow:
        probe = gate["probe"]
        raw, threshold, sharpness = probes[probe] if isinstance(probe, str) else probe
        weights = np.frombuffer(raw, dtype=F32)
        if weights.shape != (self.hidden_size,):
            raise ValueError(f"probe length {weights.shape[0]} != hidden {self.hidden_size}")
        site = (gate["hook"], gate["layer"])
        if site not in self.monitor_sites:
            raise ValueError(f"{site_name(site)} is not a monitor site")
        return ProbeRow(
            weights=weights,
            threshold=gate["threshold"] if gate["threshold"] is not None else threshold,
            sharpness=gate["sharpness"] if gate["sharpness"] is not None else sharpness,
            site=site,
        )

    def _steers(self, slot: int) -> bool:
        return bool(self._prefill_row[slot] or self._decode_row[slot] or self._probe_row[slot])

    def _contents(self, entries: list[RawEntry], vectors: dict[str, np.ndarray],
                  gated: bool = False) -> tuple[dict[str, Contents], dict[str, Projections]]:
        """The entries' adds and projections per phase (``gated``: scaled by the gate), named
        vectors taken from ``vectors``."""
        adds: dict[str, Contents] = {p: {} for p in PHASES}
        projections: dict[str, Projections] = {p: {} for p in PHASES}
        for entry in read_entries(entries):
            if entry.scale == 0:
                continue
            vec = entry.vector
            values = vectors[vec] if isinstance(vec, str) else np.frombuffer(vec, dtype=F32)
            if values.shape != (self.hidden_size,):
                raise ValueError(f"vector length {values.shape[0]} != hidden {self.hidden_size}")
            if entry.op == "add":
                scaled = values * np.float32(entry.scale)
                part = {(entry.hook, layer): scaled for layer in entry.layers}
                for phase in PHASES:
                    if entry.phase in ("all", phase):
                        adds[phase] = add_contents(adds[phase], part)
                continue
            norm = float(np.linalg.norm(values.astype(np.float64)))
            if not 0 < norm < np.inf:
                raise ValueError(f"op {entry.op!r} needs a vector with a direction")
            scale = float(entry.scale)
            item = (Projection(direction=(values / norm).astype(F32), static=0.0 if gated else
                               scale, gated=scale if gated else 0.0, value=entry.value or 0.0),)
            for phase in PHASES:
                if entry.phase in ("all", phase):
                    projections[phase] = add_projections(
                        projections[phase], {(entry.hook, layer): item for layer in entry.layers})
        return adds, projections

    def _ensure_slot(self, slot: int) -> None:
        old = len(self._prompt_len)
        if slot >= old:
            size = max(slot + 1, 2 * old)
            grown = []
            for arr in (self._prefill_row, self._decode_row, self._prompt_len, self._probe_row,
                        self._control_row, self._next_pos):
                new = np.zeros(size, dtype=arr.dtype)
                new[:old] = arr
                grown.append(new)
            (self._prefill_row, self._decode_row, self._prompt_len, self._probe_row,
             self._control_row, self._next_pos) = grown
            self._slots_version += 1

    def _assign(self, req: _Request) -> None:
        """Take the request's rows. Row keys name what determines the contents (spec key,
        phase, registry and global versions), so a request whose rows exist already takes
        them without building or hashing anything; all ranks derive the same keys. An
        unsteered request under no global steering keeps its slot's zero rows (half the
        serving mix: its admission, on the host-bound admitting step, skips the keys)."""
        if req.key == "-" and req.global_key == NO_GLOBAL:
            return
        gated, projections = req.gated, req.projections
        key = f"{req.key}|r{req.generation}"
        if req.probe is not None:
            probe_row = self.probe_table.acquire(req.probe, key=key.encode())
            if probe_row is None:
                # Without a monitor the token's gate buffer holds another token's gate: the
                # gated tier must not be read at all.
                logger.warning("dynsteer: all probe rows are in use; a request runs without "
                               "its gate (raise dynsteer.max_gates)")
                gated, key = _UNSTEERED.gated, key + "-nogate"
                projections = {p: _static_only(projections[p]) for p in PHASES}
            self._probe_row[req.slot] = probe_row or 0
        glob = self._globals[req.global_key]
        for phase, target in zip(PHASES, (self._prefill_row, self._decode_row), strict=True):
            try:
                row = self.rows.acquire_keyed(
                    f"{key}|{phase}|g{req.global_key}".encode(),
                    lambda p=phase, g=gated, j=projections: (
                        add_contents(glob.adds[p], req.own[p]), g[p],
                        add_projections(glob.projections[p], j[p])))
            except ValueError as e:  # global + own projections past max_projections
                logger.warning("dynsteer: a request runs unsteered in %s: %s (raise "
                               "dynsteer.max_projections)", phase, e)
                row = 0
            if row is None:
                logger.warning(
                    "dynsteer: all %d steering rows are in use; a request runs unsteered in %s "
                    "(raise dynsteer.max_rows)", self.rows.max_rows, phase
                )
                row = 0
            target[req.slot] = row
        if self._steers(req.slot):
            self._num_steered += 1
            self._slots_version += 1

    def _release(self, req: _Request) -> None:
        if self._steers(req.slot):
            self._num_steered -= 1
            self._slots_version += 1
        for target in (self._prefill_row, self._decode_row):
            self.rows.release(int(target[req.slot]))
            target[req.slot] = 0
        self.probe_table.release(int(self._probe_row[req.slot]))
        self._probe_row[req.slot] = 0

    def _switch(self, req_id: str, action: Action, name: str | None) -> None:
        """A controller's switch: the request's gated entries steer with registered vector
        ``name``, its gate reads registered probe ``name``, or (``STOP``) its own steering
        ends (global steering stays). KV from here on is computed under steering the request's
        cache key does not describe, so the prefix guard stops sharing it here."""
        req = self._requests[req_id]
        wire = dict(req.wire or {})
        gate = dict(wire["gate"])
        if action == Action.SWITCH_VECTOR:
            if name not in self.vectors:
                raise KeyError(f"no registered vector {name!r}")
            gate["steer"] = [list(e._replace(vector=name)) for e in read_entries(gate["steer"])]
        elif action == Action.SWITCH_PROBE:
            if name not in self.probes:
                raise KeyError(f"no registered probe {name!r}")
            gate.update(probe=name, threshold=None, sharpness=None)
        else:
            wire["steer"] = []
            gate["steer"] = []
        wire["gate"] = gate
        wire["key"] = f"{req.key}|{action.name}:{name}"
        resolved = self._resolve(wire, self._generation)
        self._release(req)
        req.own, req.gated, req.wire, req.key = resolved.own, resolved.gated, wire, wire["key"]
        req.projections = resolved.projections
        req.probe, req.generation = resolved.probe, self._generation
        self._assign(req)
        record = self.telemetry.record_of_slot(req.slot)
        self.telemetry.mark_dynamic(req.slot, self.telemetry.processed(record))

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
            "steered_requests_live": self._num_steered,
            "requests_steered_total": self.requests_steered,
            "probe_rows_in_use": self.probe_table.in_use,
            "vectors": sorted(self.vectors),
            "probes": sorted(self.probes),
            "global_entries": len(self._globals[self._current_global].entries),
            "global_steerings_held": len(self._globals),
            "registry_generation": self._generation,
            "capture_rows_in_use": self.capture.rows_in_use,
            "tokens_monitored": dict(self.telemetry.tokens_monitored),
            "tokens_gated": dict(self.telemetry.tokens_gated),
            "host_time": self.host_time.summary(),
            "index_fills": dict(self.index_fills),
        }


def _without(registry: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of ``registry`` without ``name`` (KeyError when it is not there)."""
    if name not in registry:
        raise KeyError(name)
    return {k: v for k, v in registry.items() if k != name}


def _static_only(projections: Projections) -> Projections:
    """``projections`` without the gated ones (for a request whose gate has no probe row)."""
    kept = {site: tuple(p for p in items if p.static) for site, items in projections.items()}
    return {site: items for site, items in kept.items() if items}
