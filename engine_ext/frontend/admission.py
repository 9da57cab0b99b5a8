"""What the frontend process knows about steering: model shape, registry, recent requests.

One :class:`FrontendState` lives next to each engine's input processor (offline ``LLM`` or the
API server's ``AsyncLLM``). It validates specs once and resolves them into the form the workers
read (:mod:`dynsteer.controller.wire`; identical JSON texts are not parsed again), computes the
prefix-cache guard of each request from that form's bytes,
mirrors what was registered on the workers (so the HTTP routes can list and return it without a
round trip) and keeps a bounded record of recent steered requests plus counters for metrics.
The adapter (:mod:`dynsteer.engine_ext.compat.frontend`) calls the functions at the end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from dynsteer.controller.contract import Site, SpecError, site_name
from dynsteer.controller.extra_args import (
    ACTIVATIONS_KEY,
    CLAIMS_KEY,
    GLOBAL_KEY,
    GUARD_KEY,
    REGISTRY_KEY,
    RESERVED_PREFIX,
    SPEC_KEY,
    WIRE_KEY,
)
from dynsteer.controller.limits import FLOAT32_MAX
from dynsteer.controller.spec import ModelShape, SteeringSpec, check_against_model, parse_spec
from dynsteer.controller.wire import RawEntry, fingerprint, spec_to_wire
from dynsteer.probes import ModelFingerprint, Probe

from ..compat.frontend import EngineFacts, Generation, prompt_request_ids
from ..options import CONFIG_KEY, EngineOptions, options_from_additional_config
from ..prefix_guard.guard import CacheGuard
from ..prefix_guard.key import guard_for
from ..row_budget import Claims, check_claims, claims_for
from . import request_capture
from .caller import TRUSTED, Caller, current
from .global_capture import with_global_capture

MAX_SESSIONS = 65536
"""Sessions with steering set by a controller that the frontend remembers (least recently
set forgotten first)."""
RECENT_REQUESTS = 4096
"""How many recent steered requests the frontend remembers (for the telemetry route)."""
PARSED_SPECS = 256
"""How many distinct spec texts the frontend keeps parsed (a bounded LRU)."""


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
    monitor_sites: frozenset[Site] | None = None
    """Where probes read and capture records (None: every site)."""
    architecture: str = ""
    """The served model class (``config.architectures[0]``), for probe fingerprints."""
    dtype_max: float = FLOAT32_MAX
    """Largest finite value of the model's dtype (steering must not overflow it)."""
    missing_hook: Callable[[str], str | None] | None = None
    """Why the model's layers have no such hook (:attr:`EngineFacts.missing_hook`)."""
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    """Registered vectors, checked read-only float32 (mirrors the workers)."""
    vector_norms: dict[str, float] = field(default_factory=dict)
    """L2 norm of each registered vector (specs' ``scale`` is checked against it)."""
    probes: dict[str, Probe | None] = field(default_factory=dict)
    """Registered probe names (mirrors the workers), with the :class:`~dynsteer.probes.Probe`
    each was registered as (what the HTTP routes list and return); None for one registered
    from bare weights (``Steering.register_probe(name, weights=...)``)."""
    global_entries: list[dict[str, Any]] = field(default_factory=list)
    """Current global steering entries as clients gave them (what ``GET /global`` returns)."""
    global_wire: list[RawEntry] = field(default_factory=list)
    """The same entries resolved (what the workers hold)."""
    global_key: str | None = None
    """Fingerprint of the global steering (None when there is none)."""
    registry_generation: int = 0
    """Bumped on every vector/probe (un)registration: named contents may have changed."""
    counters: FrontendCounters = field(default_factory=FrontendCounters)
    recent: OrderedDict[str, RequestRecord] = field(default_factory=OrderedDict)
    """Steered requests by the caller's request id, most recent last (bounded)."""
    parsed: OrderedDict[tuple[Any, int], tuple[SteeringSpec, dict[str, Any]]] = field(
        default_factory=OrderedDict)
    """Recently admitted spec texts (and the registry generation they were checked against)."""
    sessions: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    """Steering set for sessions' later requests (``{"steer": [wire entries], "gate": wire
    gate or None}``), by (namespaced) session name."""
    sinks: frozenset[str] = frozenset()
    """Names of the capture sinks a server configured (a spec's ``capture.sink``)."""
    global_capture: dict[str, Any] | None = None
    """A capture (``CaptureSpec`` fields, with a sink) every request that asks for none gets
    (:mod:`.global_capture`: the engine option, or ``PUT /v1/dynsteer/capture/global``)."""
    global_capture_scope: dict[str, str | None] = field(default_factory=dict)
    """Which completions the global capture covers: ``session`` (namespaced) and ``caller``
    (a key namespace), each None or absent for all."""
    default_caller: Caller = TRUSTED
    """Who a request is admitted as when nobody said (see :mod:`.caller`): the API server sets
    a keyless client, so a request that reaches admission without its caller fails closed."""

    def set_session(self, session: str, steering: dict[str, Any] | None) -> None:
        """Steer the session's later requests (None: stop)."""
        self.sessions.pop(session, None)
        if steering is not None:
            self.sessions[session] = steering
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)

    def with_session(self, wire: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """``wire`` with its session in ``caller``'s namespace, plus that session's steering:
        the session's entries after the request's own, its gate where the request has none (a
        new dict; ``wire`` may be cached)."""
        session = wire.get("session")
        if session is None:
            return wire
        owned = caller.session(session)
        if owned != session:
            wire = {**wire, "session": owned}
        steering = self.sessions.get(owned)
        if steering is None:
            return wire
        merged = {**wire, "steer": [*wire["steer"], *steering["steer"]],
                  "gate": wire["gate"] if wire["gate"] is not None else steering["gate"]}
        merged.pop("session")
        merged.pop("key")
        merged["key"] = fingerprint(merged).hex()
        merged["session"] = wire["session"]
        return merged

    def set_global(self, entries: list[dict[str, Any]], wire: list[RawEntry],
                   key: str | None) -> None:
        """Record new global steering (after every worker holds it under ``key``)."""
        self.global_entries = entries
        self.global_wire = wire
        self.global_key = key

    def admit_spec(self, raw: Any) -> tuple[SteeringSpec, dict[str, Any]]:
        """A client's spec parsed, checked against the served model and resolved for the
        workers (SpecError naming the field). Specs are cached by content: the same text (as
        ``vllm_xargs`` carries it), or the same dict (as the Python API takes it, float lists
        included), is parsed once."""
        content = _content(raw)
        key = (content, self.registry_generation) if content is not None else None
        hit = self.parsed.get(key) if key is not None else None
        if hit is not None:
            self.parsed.move_to_end(key)
            return hit
        spec = parse_spec(raw)
        check_against_model(spec, self.shape())
        result = spec, spec_to_wire(spec)
        if key is not None:
            self.parsed[key] = result
            while len(self.parsed) > PARSED_SPECS:
                self.parsed.popitem(last=False)
        return result

    def shape(self) -> ModelShape:
        return ModelShape(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            sites=frozenset(self.sites),
            monitor_sites=self.monitors,
            vector_norms=self.vector_norms,
            probe_names=frozenset(self.probes),
            max_steer_norm=self.options.max_steer_norm,
            max_projections=self.options.max_projections,
            dtype_max=self.dtype_max,
            missing_hook=self.missing_hook,
        )

    @property
    def monitors(self) -> frozenset[Site]:
        """The monitor sites (see :attr:`monitor_sites`)."""
        return frozenset(self.sites) if self.monitor_sites is None else self.monitor_sites

    def site_names(self) -> list[str]:
        """Configured sites, ``hook@layer``, in forward order."""
        return [site_name(site) for site in self.sites]

    def model(self) -> ModelFingerprint:
        """The served model, as probes' training fingerprints describe theirs."""
        return ModelFingerprint(architecture=self.architecture or "unknown",
                                hidden_size=self.hidden_size, num_layers=self.num_layers)

    def record_request(self, request_id: str, wire: dict[str, Any] | None) -> None:
        """Count a request and remember how it was steered (steered requests only), its
        session's steering included."""
        static = bool(self.global_entries) or bool(wire and wire["steer"])
        gated = bool(wire and wire["gate"] is not None)
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
        for key in prompt_request_ids(request_id):
            if key in self.recent:
                return key, self.recent[key]
        return None

    def claims(self, wire: dict[str, Any] | None) -> Claims | None:
        """The steering and probe rows a request takes on the workers (see
        :mod:`..row_budget`)."""
        return claims_for(wire, self.global_wire, self.global_key, self.registry_generation)

    def cache_guard(self, wire: dict[str, Any] | None, prompt_len: int,
                    own_from: int | None = None) -> CacheGuard | None:
        """How a request's blocks may be shared (see :func:`..prefix_guard.key.guard_for`)."""
        return guard_for(wire, self.global_wire, self.global_key, self.registry_generation,
                         prompt_len, own_from)


def _content(raw: Any) -> Any:
    """What identifies a spec's content (None: not cacheable). A dict is its msgpack bytes: a
    few microseconds for thousands of floats, where validating them again costs a hundred;
    floats, ints and booleans encode apart, so only the same values share a parse."""
    if isinstance(raw, (str, bytes)):
        return raw
    if isinstance(raw, dict):
        try:
            return ("dict", msgspec.msgpack.encode(raw))
        except Exception:  # not plain data (arrays, models, cycles): parsed every time
            return None
    return None


# ---- what the adapter calls (see dynsteer.engine_ext.compat.frontend.FrontendHooks) ----------
def configure(additional_config: dict[str, Any]) -> dict[str, Any] | None:
    """``additional_config`` with the dynsteer options normalized (None: not enabled)."""
    options = options_from_additional_config(additional_config)
    if options is None:
        return None
    return {**additional_config, CONFIG_KEY: options.model_dump()}


def engine_state(facts: EngineFacts) -> FrontendState | None:
    options = options_from_additional_config(facts.additional_config)
    if options is None:
        return None
    sites = options.engine_sites(facts.num_layers)
    return FrontendState(
        options=options,
        hidden_size=facts.hidden_size,
        num_layers=facts.num_layers,
        sites=sites.all,
        monitor_sites=sites.monitor,
        architecture=facts.architecture,
        dtype_max=facts.dtype_max,
        missing_hook=facts.missing_hook,
        global_capture=options.global_capture,
    )


def _refuse_reserved(extra_args: dict[str, Any]) -> None:
    reserved = sorted(k for k in extra_args if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
    if reserved:
        raise SpecError(f"vllm_xargs.{reserved[0]}: reserved for dynsteer's own use; a "
                        f"steering spec goes in vllm_xargs.{SPEC_KEY} or a top-level "
                        f"{SPEC_KEY!r} object")


def admit(state: FrontendState | None,
          extra_args: dict[str, Any] | None) -> tuple[SteeringSpec, dict[str, Any]] | None:
    """A request's spec checked against the served model and resolved for the workers, its
    session in the namespace of the request's caller (None: no spec); raises naming the field.
    A client's request carrying dynsteer's reserved keys is refused."""
    caller = current(state.default_caller if state is not None else TRUSTED)
    if extra_args and caller.client:
        try:
            _refuse_reserved(extra_args)
        except SpecError:
            if state is not None:
                state.counters.requests_rejected += 1
            raise
    if state is not None and state.global_capture is not None:
        extra_args = with_global_capture(state, extra_args)
    if not extra_args or SPEC_KEY not in extra_args:
        return None
    if state is None:
        raise SpecError(
            f"extra_args.{SPEC_KEY}: this engine was started without dynsteer; start it "
            f"with additional_config={{'{CONFIG_KEY}': {{}}}}"
        )
    try:
        spec, wire = state.admit_spec(extra_args[SPEC_KEY])
        wire = state.with_session(wire, caller)
    except ValueError:
        state.counters.requests_rejected += 1
        raise
    return spec, wire


def precheck(state: FrontendState, extra_args: dict[str, Any] | None) -> SteeringSpec | None:
    """Refuse now what :func:`admit` and :func:`admitted` would refuse (ValueError naming the
    field). The API server calls it before a completion route answers: vLLM admits a
    streaming request only after its 200 has started, so a bad spec would otherwise reach the
    client as an error event in a 200 stream. The parse is cached, so admission does not
    repeat it. Returns the request's spec (None: it has none)."""
    spec = admit(state, extra_args)
    if spec is None:
        return None
    _checked_claims(state, spec[1])
    return spec[0]


def _checked_claims(state: FrontendState, wire: dict[str, Any] | None) -> Claims | None:
    """The request's row claims, refused when it alone needs more rows than the engine has
    (it would wait for them forever)."""
    claims = state.claims(wire)
    try:
        check_claims(claims, state.options.max_rows,
                     state.options.max_gates or state.options.max_rows)
    except ValueError:
        state.counters.requests_rejected += 1
        raise
    return claims


def admitted(state: FrontendState, request_id: str,
             spec: tuple[SteeringSpec, dict[str, Any]] | None, prompt_len: int,
             generation: Generation, extra_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """Record the request and replace the client's spec with its resolved form (what the
    workers read, :mod:`dynsteer.controller.wire`, with the registry generation its names
    resolve in) and its prefix-cache guard (what the
    scheduler reads, :mod:`..prefix_guard`) and row claims (:mod:`..row_budget`). Keys only the
    frontend may set are overwritten. A request that alone needs more rows than the engine has
    (it would wait for them forever) is refused here, naming the option; so is a capture the
    engine cannot hold (:mod:`.request_capture`)."""
    wire = spec[1] if spec is not None else None
    capture = spec[0].capture if spec is not None else None
    claims = _checked_claims(state, wire)
    activations = None
    if capture is not None:
        try:
            activations = request_capture.admit(capture, state.shape(), state.options,
                                                prompt_len, generation, state.sinks)
            if activations["sink"] is not None:  # kept in the sink's index line
                activations["meta"] = {"caller": current(state.default_caller).namespace
                                       or "-"}
        except ValueError:
            state.counters.requests_rejected += 1
            raise
    state.record_request(request_id, wire)
    guard = state.cache_guard(
        wire, prompt_len, request_capture.first_captured_prompt_position(capture, prompt_len))
    extra = {k: v for k, v in (extra_args or {}).items()
             if k not in (GUARD_KEY, SPEC_KEY, WIRE_KEY, GLOBAL_KEY, CLAIMS_KEY, REGISTRY_KEY,
                          ACTIVATIONS_KEY)}
    if activations is not None:
        extra[ACTIVATIONS_KEY] = activations
    if wire is not None:
        extra[WIRE_KEY] = wire
        extra[REGISTRY_KEY] = state.registry_generation
    if claims is not None:
        extra[CLAIMS_KEY] = claims.to_extra()
    if state.global_key is not None:
        extra[GLOBAL_KEY] = state.global_key
    if guard is not None:
        extra[GUARD_KEY] = guard.model_dump()
    return extra or None
