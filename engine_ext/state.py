"""Worker-side steering state: named vectors, global steering and per-request rows.

Every worker (every TP rank) holds one :class:`SteeringState` and receives the same control
calls and the same scheduler output, so rows are allocated identically on every rank.

Requests are tracked by *slot*: a small integer the runner adapter chooses (the V2 runner's own
request slot, or one the V1 adapter allocates). Per-slot numpy arrays make the per-step index
fill a vectorized gather.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dynsteer.controller.spec import SPEC_KEY, SteerEntry, parse_entries, parse_spec
from dynsteer.engine_ext.options import Site
from dynsteer.engine_ext.rows import Contents, RowTable, add_contents
from dynsteer.engine_ext.token_rows import TokenRows

logger = logging.getLogger(__name__)

PHASES: tuple[Literal["prefill"], Literal["decode"]] = ("prefill", "decode")


@dataclass
class _Request:
    slot: int
    own: dict[str, Contents]
    """This request's own steering per phase (global steering excluded)."""


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
    ) -> None:
        self.sites = sites
        self.hidden_size = hidden_size
        self.rows = RowTable(sites, hidden_size, max_rows, device)
        self.token_rows = TokenRows(max_tokens, device)
        self.vectors: dict[str, np.ndarray] = {}
        self._global_entries: list[SteerEntry] = []
        self._global: dict[str, Contents] = {p: {} for p in PHASES}
        self._requests: dict[str, _Request] = {}
        self._prefill_row = np.zeros(max_slots, dtype=np.int32)
        self._decode_row = np.zeros(max_slots, dtype=np.int32)
        self._prompt_len = np.zeros(max_slots, dtype=np.int64)
        self._num_steered = 0
        self.requests_steered = 0
        """Requests admitted with a nonzero row (counter)."""

    # ---- control plane -------------------------------------------------------------------
    def register_vector(self, name: str, values: list[float] | np.ndarray) -> None:
        """Add or replace a named vector (requests already admitted keep the old values)."""
        vec = np.asarray(values, dtype=np.float32)
        if vec.shape != (self.hidden_size,) or not np.isfinite(vec).all():
            raise ValueError(
                f"vector {name!r}: expected {self.hidden_size} finite floats, got shape {vec.shape}"
            )
        self.vectors[name] = vec

    def unregister_vector(self, name: str) -> None:
        """Remove a named vector; unknown names raise ``KeyError``."""
        del self.vectors[name]

    def set_global(self, entries: list[SteerEntry] | list[dict[str, Any]] | str) -> None:
        """Replace global steering; every live request is re-resolved against it."""
        parsed = parse_entries(entries)
        contents = self._contents(parsed)
        self._global_entries = parsed
        self._global = contents
        for req in self._requests.values():
            self._release(req)
            self._assign(req)

    def global_entries(self) -> list[SteerEntry]:
        """The entries of the current global steering."""
        return list(self._global_entries)

    # ---- request lifecycle ---------------------------------------------------------------
    def add_request(self, req_id: str, slot: int, extra_args: Any, prompt_len: int) -> None:
        """Admit a request: resolve its spec and take its rows.

        Specs were validated by the frontend; if one still cannot be served (a vector name
        removed in between, no free row) the request runs unsteered and a warning is logged:
        a step must never fail because of one request.
        """
        self.remove_request(req_id)
        own: dict[str, Contents] = {p: {} for p in PHASES}
        raw = extra_args.get(SPEC_KEY) if isinstance(extra_args, dict) else None
        if raw is not None:
            try:
                own = self._contents(parse_spec(raw).steer)
            except (ValueError, KeyError) as e:
                logger.warning("dynsteer: request %s runs unsteered: %s", req_id, e)
        req = _Request(slot=slot, own=own)
        self._ensure_slot(slot)
        self._requests[req_id] = req
        self._prompt_len[slot] = prompt_len
        self._assign(req)
        if self._prefill_row[slot] or self._decode_row[slot]:
            self.requests_steered += 1

    def remove_request(self, req_id: str) -> None:
        """Release a finished (or re-added) request's rows."""
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._release(req)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def any_steered(self) -> bool:
        """Whether any live request uses a nonzero row (else the step needs no fill)."""
        return self._num_steered > 0

    # ---- per step ------------------------------------------------------------------------
    def fill(self, slots: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Fill the token index for one step; arrays are per request in batch order."""
        self.token_rows.fill(
            self._prefill_row[slots],
            self._decode_row[slots],
            self._prompt_len[slots],
            num_computed,
            num_scheduled,
        )

    # ---- internals -----------------------------------------------------------------------
    def _contents(self, entries: list[SteerEntry]) -> dict[str, Contents]:
        out: dict[str, Contents] = {p: {} for p in PHASES}
        for entry in entries:
            if entry.scale == 0:
                continue
            vec = self.vectors[entry.vector] if isinstance(entry.vector, str) else entry.vector
            scaled = np.asarray(vec, dtype=np.float32) * np.float32(entry.scale)
            if scaled.shape != (self.hidden_size,):
                raise ValueError(f"vector length {scaled.shape[0]} != hidden {self.hidden_size}")
            for phase in PHASES:
                if entry.applies_to(phase):
                    for layer in entry.layers:
                        out[phase] = add_contents(out[phase], {(entry.hook, layer): scaled})
        return out

    def _ensure_slot(self, slot: int) -> None:
        old = len(self._prompt_len)
        if slot >= old:
            size = max(slot + 1, 2 * old)
            grown = []
            for arr in (self._prefill_row, self._decode_row, self._prompt_len):
                new = np.zeros(size, dtype=arr.dtype)
                new[:old] = arr
                grown.append(new)
            self._prefill_row, self._decode_row, self._prompt_len = grown

    def _assign(self, req: _Request) -> None:
        for phase, target in zip(PHASES, (self._prefill_row, self._decode_row), strict=True):
            row = self.rows.acquire(add_contents(self._global[phase], req.own[phase]))
            if row is None:
                logger.warning(
                    "dynsteer: all %d steering rows are in use; a request runs unsteered in %s "
                    "(raise dynsteer.max_rows)", self.rows.max_rows, phase
                )
                row = 0
            target[req.slot] = row
        if self._prefill_row[req.slot] or self._decode_row[req.slot]:
            self._num_steered += 1

    def _release(self, req: _Request) -> None:
        if self._prefill_row[req.slot] or self._decode_row[req.slot]:
            self._num_steered -= 1
        for target in (self._prefill_row, self._decode_row):
            self.rows.release(int(target[req.slot]))
            target[req.slot] = 0

    def info(self) -> dict[str, Any]:
        """Counters for tests, metrics and the info RPC."""
        return {
            "sites": [f"{hook}@{layer}" for hook, layer in self.sites],
            "rows_in_use": self.rows.in_use,
            "rows_rejected": self.rows.rejected,
            "max_rows": self.rows.max_rows,
            "live_requests": len(self._requests),
            "steered_requests_live": self._num_steered,
            "requests_steered_total": self.requests_steered,
            "vectors": sorted(self.vectors),
            "global_entries": len(self._global_entries),
        }
