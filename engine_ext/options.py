"""Engine options: ``additional_config={"dynsteer": {...}}``, validated once per engine.

The set of sites (:mod:`dynsteer.controller.contract` has the grammar) is fixed when the engine
starts because it is baked into the compiled graph: layers without a site pay nothing. Of those,
only *monitor sites* (where probes read the stream and capture records it) run dynsteer's own
kernel; every other site steers by plain tensor ops the compiler fuses into the next layer's
kernels, so an idle or statically steered site adds no kernel launch.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dynsteer.controller.capture_store import sink_settings
from dynsteer.controller.contract import Site, check_site_grammar, resolve_sites, site_order
from dynsteer.controller.limits import DEFAULT_MAX_STEER_NORM
from dynsteer.controller.spec import SINK_PATTERN, CaptureSpec

from .plugin import CONFIG_KEY, requested

PLUGIN_VERSION = "0.1.0"
KERNEL_ABI = 14
"""Bumped whenever the in-graph ops change, so compile caches of older graphs are not reused."""


DEFAULT_MONITOR_SITES = "post_block@25%+50%+75%"
"""``post_block`` at a quarter, half and three quarters of the depth."""


class EngineSites(NamedTuple):
    """An engine's sites in one model: all of them, in forward order, and the monitor sites."""

    all: tuple[Site, ...]
    monitor: frozenset[Site]


class EngineOptions(BaseModel):
    """Options of the dynsteer plugin for one engine."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """Turns the plugin on for this engine (an empty dict also enables it)."""
    sites: Annotated[str | list[str], Field(min_length=1)] = "post_block@*"
    """Which (hook, layer) sites can be steered: one or more ``hook@layers`` items,
    comma-separated or as a list, e.g. ``"post_block@*"``, ``"pre_attn@0-3"``,
    ``"post_attn@5+7"`` or ``"post_block@50%"`` (grammar: docs/options.md#sites). Monitor
    sites are added to them. Fixed at startup: the sites are baked into the compiled graph, so
    changing them recompiles the model."""
    monitor_sites: str | list[str] = DEFAULT_MONITOR_SITES
    """Sites where probes can read the stream (gates) and activations can be
    captured; they can be steered too. Each runs the monitor kernel, a launch of its own in
    every forward (docs/performance.md#kernels-and-host-work). ``""`` for none;
    ``"post_block@*"`` to choose a probe's layer from all of them."""
    max_rows: int = Field(default=64, ge=1, le=4096)
    """Distinct steering rows in flight: one per distinct content (a phase's own, global
    and gated vectors per site); specs with equal contents share a row. Each row costs
    ``2 * sites * hidden * 4`` bytes of device memory (1 MiB for 32 sites at hidden 4096). A
    config's row stays in the table after its last request finishes and is reused by the next
    request of equal contents; a new config takes the least recently used idle row. With
    every row in use, the scheduler keeps the requests that would need a new row waiting in
    its queue until one is free (everything that fits runs meanwhile; metric
    ``dynsteer_requests_waited_for_rows_total``); a spec that alone needs more rows than this
    is refused, naming the option."""
    max_projections: int = Field(default=0, ge=0, le=16)
    """Ablate / clamp / ``norm_match`` entries one kind of token may have at one
    site: the projection slots of a row. 0 turns them off and costs nothing; each slot costs
    ``sites * (max_rows + 1) * (hidden + 5) * 4`` bytes of device memory (about 33 MiB for 32
    sites, 64 rows, hidden 4096), and a steered token reads its row's slots at every site (one
    dot product per slot)."""
    site_groups: bool = True
    """Whether a fused site (one that is not a monitor site) skips the row of a token
    whose row steers no site of its group of consecutive sites, so a vector at layer 16 is read
    at one or two sites, not at all of them. ``false`` compiles the form without groups (a
    steered token's row read at every site), a baseline for benchmarks."""
    persistent_sites: bool = True
    """Whether, on CUDA, the kernel a fused site is in (the next layer's add +
    RMSNorm, which torch.compile writes) is a persistent reduction, one pass over the row as
    stock vLLM's norms run, for rows of up to 4096 elements (wider rows keep the looped
    kernel). ``false`` leaves the choice to Inductor, which writes that kernel looped, slower
    at decode batch sizes; a baseline for benchmarks."""
    fused_norms: bool = False
    """Whether, on CUDA, a site whose stream the next RMSNorm adds (``post_block``,
    ``post_attn``) runs inside that norm's Triton kernel (``dynsteer::steer_norm``: one kernel
    for the site and the norm). Off by default: on serving traffic it makes the steps that
    admit a request slower (a higher ITL p99 and TTFT than plain vLLM's), while decode steps
    are a little faster (docs/performance.md#kernels-and-host-work). Off, torch.compile fuses
    the site's ops into the norm's kernel, and a monitor site runs a kernel of its own. Where
    vLLM fuses something into the norm itself (a quantization, a tensor-parallel all-reduce,
    sequence parallelism), sites stay out of the norm regardless, so vLLM's fusion stays."""
    max_gates: int = Field(default=128, ge=1, le=65536)
    """Distinct probes (each with its threshold, sharpness and monitor site) gating
    requests in flight; each costs ``hidden * 4`` bytes of device memory. With every probe row
    in use, the scheduler keeps the requests that would need a new one waiting, as for
    ``max_rows``."""
    max_steer_norm: float = Field(default=DEFAULT_MAX_STEER_NORM, gt=0, le=1e12)
    """Largest ``‖scale · vector‖`` (L2) one steering entry may add, checked for
    every spec, global entry and registered vector (HTTP 400, or ``ValueError`` offline, above
    it)."""
    max_vectors: int = Field(default=256, ge=0, le=65536)
    """Named vectors that may be registered at once (a full registry answers HTTP
    409)."""
    max_probes: int = Field(default=256, ge=0, le=65536)
    """Named probes that may be registered at once (a full registry answers HTTP
    409)."""
    capture_lanes: int = Field(default=4, ge=0, le=256)
    """Sites captured at once across the engine (requests capturing the same site
    share one lane; a probe-training capture of more sites takes more passes over the
    prompts). Costs ``capture_lanes * (capture_tokens + 1) * hidden * 4`` bytes of device
    memory per worker (64 MiB at the defaults and hidden 4096); 0 turns capture off."""
    capture_tokens: int = Field(default=1024, ge=1, le=1 << 20)
    """Capture rows per lane: a request capturing its own activations holds its
    prompt plus ``max_tokens - 1`` of them until they are collected (one that could never fit
    is refused); a probe-training round holds prompts whose lengths sum to at most this."""
    capture_max_bytes: int = Field(default=128 << 20, ge=1)
    """Bytes of activations one capture may return at most: a request's own rows (its sites
    times the positions it may compute, in its dtype), or a whole probe-training capture's
    result. A larger one is refused before it runs (HTTP 400), naming this option; rows that
    go to a capture sink do not count, since they never pass through the response."""
    capture_sinks: dict[Annotated[str, Field(pattern=SINK_PATTERN)], str] = Field(
        default_factory=dict)
    """The engine's own capture sinks, by name: a folder, optionally with settings
    as a query (``acts/?shard_bytes=268435456&policy=drop&seal_after_s=60&queue_size=1024``).
    A request whose capture names one (``"sink": NAME``) has its rows written there by the
    workers as it runs, in safetensors shards read back with ``dynsteer.capture.open``,
    instead of returned with its output
    (docs/capture.md#the-engines-own-sinks-rows-on-disk-while-requests-run)."""
    global_capture: dict[str, Any] | None = None
    """A capture (a spec's ``capture`` fields, whose ``sink`` names one of
    :attr:`capture_sinks`) that every request asking for none gets, from the engine's start:
    collecting a dataset while serving. On a server, ``PUT /v1/dynsteer/capture/global``
    replaces it (and may scope it to a session or an API key)."""
    events_address: str | None = None
    """Where the engine publishes controller events (ZeroMQ PUB, e.g.
    ``tcp://127.0.0.1:5557``); ``null``: no events. A non-loopback address needs CURVE keys
    (``DYNSTEER_ZMQ_SERVER_KEY``). See docs/gating.md#asynchronous-controllers."""
    events_every: int = Field(default=16, ge=1, le=1 << 20)
    """Engine steps per monitor-summary event (1: every step)."""
    events_queue: int = Field(default=4096, ge=1, le=1 << 20)
    """Events waiting to be sent; when full, new events are dropped and counted, so
    a slow or absent subscriber never delays a step."""
    commands_address: str | None = None
    """Where the API server takes controller commands (ZeroMQ ROUTER);
    ``null``: off."""
    plugin_version: str = PLUGIN_VERSION
    """Set by the plugin: part of vLLM's compile-cache key; do not set it."""
    kernel_abi: int = KERNEL_ABI
    """Set by the plugin: part of vLLM's compile-cache key; do not set it."""

    @field_validator("events_address", "commands_address")
    @classmethod
    def _check_address(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{v!r} is not a ZeroMQ address (tcp://HOST:PORT or ipc://PATH)")
        return v

    @field_validator("capture_sinks")
    @classmethod
    def _check_sinks(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            sink_settings(name, value)
        return v

    @model_validator(mode="after")
    def _check_global_capture(self) -> EngineOptions:
        capture = self.global_capture
        if capture is None:
            return self
        try:
            parsed = CaptureSpec.model_validate(capture)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"global_capture{'.' + where if where else ''}: "
                             f"{first['msg']}") from None
        if parsed.sink not in self.capture_sinks:
            known = ", ".join(sorted(self.capture_sinks)) or "none"
            raise ValueError(f"global_capture.sink: name one of capture_sinks (configured: "
                             f"{known}); a global capture's rows have no response to go to")
        self.global_capture = parsed.model_dump(exclude_none=True)
        return self

    @field_validator("sites", "monitor_sites")
    @classmethod
    def _check_site_grammar(cls, v: str | list[str]) -> str | list[str]:
        check_site_grammar(v)
        return v

    def engine_sites(self, num_layers: int) -> EngineSites:
        """The sites in a model of ``num_layers`` layers (ValueError naming the option)."""
        monitor = resolve_sites(self.monitor_sites, num_layers, field="dynsteer.monitor_sites")
        steered = resolve_sites(self.sites, num_layers)
        every = sorted(set(steered) | set(monitor), key=lambda s: site_order(*s))
        return EngineSites(all=tuple(every), monitor=frozenset(monitor))


RUNTIME_OPTIONS = frozenset({"max_steer_norm", "max_vectors", "max_probes", "events_address",
                             "events_every", "events_queue", "commands_address",
                             "capture_sinks", "capture_max_bytes", "global_capture"})
"""Options that never reach the compiled graph (checks, registry caps, sockets): left out of
vLLM's compile-cache key, so changing one does not recompile the model."""


def compile_key_config(additional_config: dict[str, Any]) -> dict[str, Any]:
    """``additional_config`` as vLLM's compile-cache key is to see it: the dynsteer options
    without :data:`RUNTIME_OPTIONS` (the same object when it has none of them)."""
    raw = additional_config.get(CONFIG_KEY)
    if not isinstance(raw, dict) or not RUNTIME_OPTIONS & raw.keys():
        return additional_config
    return {**additional_config,
            CONFIG_KEY: {k: v for k, v in raw.items() if k not in RUNTIME_OPTIONS}}


def options_from_additional_config(additional_config: Any) -> EngineOptions | None:
    """The plugin's options for an engine, or None when the plugin is not enabled for it."""
    if not requested(additional_config):
        return None
    raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config.{CONFIG_KEY} must be a dict, got {type(raw).__name__}")
    try:
        options = EngineOptions.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"additional_config.{CONFIG_KEY}.{field}: {first['msg']}") from e
    return options if options.enabled else None
