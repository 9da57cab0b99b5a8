"""What the frontend process knows about steering: model shape, registry, recent requests.

One :class:`FrontendState` lives next to each engine's input processor (offline ``LLM`` or the
API server's ``AsyncLLM``). It validates specs, computes the prefix-cache guard of each request,
mirrors what was registered on the workers (so the HTTP routes can list and return it without a
round trip) and keeps a bounded record of recent steered requests plus counters for metrics.
It has no vLLM import: :mod:`.compat` builds it from the engine config.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dynsteer.controller.limits import FLOAT32_MAX
from dynsteer.controller.spec import ModelShape, SteeringSpec
from dynsteer.engine_ext.options import EngineOptions, Site
from dynsteer.engine_ext.prefix_guard import CacheGuard

RECENT_REQUESTS = 4096
"""How many recent steered requests the frontend remembers (for the telemetry route)."""


@dataclass
class RequestRecord:
    """How one request was steered, as seen when it was admitted."""

    static: bool
    """It had static entries (its own or global)."""
    gated: bool
    """It had a probe gate."""


@dataclass
class FrontendCounters:
    """Monotonic counters exported as Prometheus metrics."""

    requests_static: int = 0
    requests_gated: int = 0
    requests_rejected: int = 0
    """Requests whose spec failed validation."""


@dataclass
class FrontendState:
    """The frontend's view of one dynsteer-enabled engine."""

    options: EngineOptions
    hidden_size: int
    num_layers: int
    sites: tuple[Site, ...]
    architecture: str = ""
    """The served model class (``config.architectures[0]``), for probe fingerprints."""
    dtype_max: float = FLOAT32_MAX
    """Largest finite value of the model's dtype (steering must not overflow it)."""
    vectors: dict[str, list[float]] = field(default_factory=dict)
    """Registered vectors (mirrors the workers)."""
    vector_norms: dict[str, float] = field(default_factory=dict)
    """L2 norm of each registered vector (specs' ``scale`` is checked against it)."""
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Registered probes as their JSON description (mirrors the workers)."""
    global_entries: list[dict[str, Any]] = field(default_factory=list)
    """Current global steering entries (mirrors the workers)."""
    registry_generation: int = 0
    """Bumped on every vector/probe (un)registration: named contents may have changed."""
    counters: FrontendCounters = field(default_factory=FrontendCounters)
    recent: OrderedDict[str, RequestRecord] = field(default_factory=OrderedDict)
    """Steered requests by the caller's request id, most recent last (bounded)."""

    @property
    def global_fingerprint(self) -> str | None:
        """Fingerprint of the current global steering (None when there is none)."""
        if not self.global_entries:
            return None
        payload = json.dumps(self.global_entries, sort_keys=True).encode()
        return hashlib.blake2b(payload, digest_size=12).hexdigest()

    @property
    def global_phase_specific(self) -> bool:
        return any(e.get("phase", "all") != "all" for e in self.global_entries)

    def shape(self) -> ModelShape:
        return ModelShape(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            sites=frozenset(self.sites),
            vector_norms=self.vector_norms,
            probe_names=frozenset(self.probes),
            max_steer_norm=self.options.max_steer_norm,
            dtype_max=self.dtype_max,
        )

    def site_names(self) -> list[str]:
        """Configured sites, ``hook@layer``, in forward order."""
        return [f"{hook}@{layer}" for hook, layer in self.sites]

    def record_request(self, request_id: str, spec: SteeringSpec | None) -> None:
        """Count a request and remember how it was steered (steered requests only)."""
        static = bool(self.global_entries) or bool(spec and spec.steer)
        gated = bool(spec and spec.gate)
        if not (static or gated):
            return
        self.counters.requests_static += static
        self.counters.requests_gated += gated
        self.recent[request_id] = RequestRecord(static=static, gated=gated)
        self.recent.move_to_end(request_id)
        while len(self.recent) > RECENT_REQUESTS:
            self.recent.popitem(last=False)

    def find_recent(self, request_id: str) -> tuple[str, RequestRecord] | None:
        """A recent request by the caller's id: exact, else the first ``id-<i>`` sub-request
        (vLLM's completion route numbers the prompts of one call)."""
        record = self.recent.get(request_id)
        if record is not None:
            return request_id, record
        for i in range(8):
            key = f"{request_id}-{i}"
            if key in self.recent:
                return key, self.recent[key]
        return None

    def cache_guard(self, spec: SteeringSpec | None, prompt_len: int) -> CacheGuard | None:
        """How a request's blocks may be shared (None: unsteered, share everything).

        The key covers everything that changes the request's KV: its spec, the global steering
        and the registry generation (named vectors/probes may have changed). With
        phase-specific entries a position's KV also depends on whether it is a prompt or a
        generated position, so the prompt length joins the key. See :mod:`.prefix_guard`.
        """
        static = [*self.global_entries, *(e.model_dump() for e in (spec.steer if spec else []))]
        static = [e for e in static if e.get("scale", 1.0) != 0]
        gated = spec is not None and spec.gate is not None
        if gated or any(e.get("phase", "all") != "decode" for e in static):
            fork = 0
        elif static:
            fork = prompt_len
        else:
            return None
        h = hashlib.blake2b(digest_size=12)
        h.update(spec.model_dump_json().encode() if spec is not None else b"-")
        h.update(f"|global={self.global_fingerprint}|registry={self.registry_generation}"
                 .encode())
        if self._phase_specific(spec):
            h.update(f"|prompt_len={prompt_len}".encode())
        return CacheGuard(key=h.hexdigest(), fork=fork, withhold=gated)

    def _phase_specific(self, spec: SteeringSpec | None) -> bool:
        """Whether any entry steers prompt and generated positions differently."""
        if self.global_phase_specific:
            return True
        if spec is None:
            return False
        entries = [*spec.steer, *(spec.gate.steer if spec.gate else [])]
        return any(e.phase != "all" for e in entries)
