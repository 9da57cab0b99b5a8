"""The per-request steering spec: what a client puts in ``extra_args["dynsteer"]``.

This module is the contract between clients and the engine. It has no vLLM import so clients,
the HTTP layer and tests can validate a spec without an engine. Two layers of checks:

* :func:`parse_spec` checks the *shape* (types, finite numbers, known hooks and phases);
* :func:`check_against_model` checks it against one served model (hidden size, layers, the
  configured sites and the registered vector names).

Every error is a :class:`SpecError` (a ``ValueError``) whose message starts with the field path,
e.g. ``dynsteer.steer[0].vector: expected 576 floats (the model's hidden size), got 3``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .contract import (
    Hook,
    Site,
    decode_f32,
    missing_site,
    resolve_sites,
    site_order,
    unconfigured_site,
    unmonitored_site,
)
from .extra_args import SPEC_KEY
from .limits import (
    DEFAULT_MAX_STEER_NORM,
    FLOAT32_MAX,
    FiniteFloat,
    SpecError,
    as_float32_vector,
    check_probe_numbers,
    check_steer_magnitude,
    float_error_message,
)
from .positions import MAX_CUTS, Positions, cuts

Phase = Literal["all", "prefill", "decode"]
"""``prefill``: prompt positions; ``decode``: generated positions; ``all``: both."""

Op = Literal["add", "ablate", "clamp"]
"""What an entry does to the stream ``x`` with ``d = vector / ‖vector‖``: ``add`` adds
``scale · vector``; ``ablate`` subtracts ``scale · (x·d) d`` (scale 1 removes the direction);
``clamp`` adds ``scale · (value - x·d) d`` (scale 1 sets the projection to ``value``)."""
PROJECTIONS: tuple[Op, ...] = ("ablate", "clamp")
"""The ops that act on the stream's projection on a direction (the engine's projection slots,
engine option ``max_projections``)."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays and objects accepted in a spec given as JSON text, and in a
request body that carries one (a full spec needs 5 levels). Deeper input is a
:class:`SpecError` before ``json.loads`` sees it (its recursion would fail far deeper)."""

MAX_ENTRIES = 64
"""Most steer entries in one list (``steer``, ``gate.steer``, global steering)."""

MAX_LAYERS = 1024
"""Most layers in one entry's ``layers`` list."""

Layer = Annotated[int, Field(strict=True, ge=0)]
"""A decoder layer index (a JSON integer; never a string or a boolean)."""


class SteerEntry(BaseModel):
    """One steering vector at one hook of some layers: added to the stream, or a direction
    the stream's projection on is removed or pinned (``op``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vector: list[FiniteFloat] | str | None = None
    """The vector (hidden-size floats) or the name of a registered vector."""
    vector_b64: str | None = None
    """The vector as base64 little-endian float32: the fast form (no decimal text to parse);
    give exactly one of ``vector`` and ``vector_b64``."""
    layers: list[Layer] = Field(min_length=1, max_length=MAX_LAYERS)
    """Decoder layers (0-based) to steer; each (layer, hook) must be a configured site."""
    hook: Hook = "post_block"
    """Where in the layer: ``pre_attn``, ``post_attn`` or ``post_block``."""
    scale: FiniteFloat = 1.0
    """Multiplier of the vector; ``0`` disables the entry."""
    phase: Phase = "all"
    """Which positions: prompt (``prefill``), generated (``decode``) or ``all``."""
    positions: Positions | None = None
    """Only these positions of the request (None: every one): ``"prompt"``, ``"generated"``,
    ``"all"``, ``"last_prompt"``, or a list of positions and ranges: ``5``, ``-1`` (from the
    end of the prompt), ``"g0"`` (the first generated token), ``"a:b"`` with ends of those
    forms, either left open (``"g2:"``, ``":-4"``). A token is steered where ``phase`` and
    ``positions`` both include it. Not for global steering, which has no prompt to count
    from."""
    op: Op = "add"
    """``add`` (default), ``ablate`` or ``clamp`` (see :data:`Op`); ``ablate`` and ``clamp``
    use the vector's direction only, so its norm does not matter (it must not be zero)."""
    value: FiniteFloat | None = None
    """The projection ``clamp`` pins the stream to (required by ``clamp``, refused by the
    others)."""
    norm_match: bool = False
    """``add`` only: add ``scale · ‖stream‖ · vector / ‖vector‖``, the stream's norm taken at
    each token and site before the site's steering (fp32), so one scale means the same at
    every layer and in every model. Takes a projection slot (engine option
    ``max_projections``); gated entries multiply it by the gate."""

    @model_validator(mode="after")
    def _one_vector(self) -> SteerEntry:
        if (self.vector is None) == (self.vector_b64 is None):
            raise ValueError("give exactly one of vector (floats or a name) or vector_b64")
        if self.norm_match and self.op != "add":
            raise ValueError(f"norm_match is for op 'add' (this entry's op is {self.op!r})")
        if (self.op == "clamp") != (self.value is not None):
            raise ValueError("op 'clamp' needs a value (the projection to pin the stream to)"
                             if self.op == "clamp" else
                             f"value is only for op 'clamp' (this entry's op is {self.op!r})")
        return self

    @property
    def name(self) -> str | None:
        """The registered vector's name, None for an inline vector."""
        return self.vector if isinstance(self.vector, str) else None

    def values(self) -> np.ndarray:
        """The inline vector as float32 (raises SpecError naming ``vector_b64`` if malformed)."""
        if self.vector_b64 is not None:
            return decode_f32("vector_b64", self.vector_b64)
        return np.asarray(self.vector, dtype=np.float32)

    def applies_to(self, phase: Literal["prefill", "decode"]) -> bool:
        """Whether this entry steers tokens of ``phase``."""
        return self.phase in ("all", phase)


class InlineProbe(BaseModel):
    """A linear probe given inline in a request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: list[FiniteFloat] | None = Field(default=None, min_length=1)
    """Hidden-size weights; ``score = stream · weights`` (fp32 accumulate)."""
    weights_b64: str | None = None
    """The weights as base64 little-endian float32 (the fast form); exactly one of the two."""
    threshold: FiniteFloat = 0.0
    """Score at which the gate is 0.5."""
    sharpness: Annotated[FiniteFloat, Field(gt=0)] = 1.0
    """Slope of the sigmoid: ``gate = sigmoid(sharpness * (score - threshold))``."""

    @model_validator(mode="after")
    def _one_weights(self) -> InlineProbe:
        if (self.weights is None) == (self.weights_b64 is None):
            raise ValueError("give exactly one of weights or weights_b64")
        return self

    def values(self) -> np.ndarray:
        """The weights as float32 (raises SpecError naming ``weights_b64`` if malformed)."""
        if self.weights_b64 is not None:
            return decode_f32("weights_b64", self.weights_b64)
        return np.asarray(self.weights, dtype=np.float32)


class GateSpec(BaseModel):
    """Probe-gated dynamic steering: the model's own activations decide, token by token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    probe: str | InlineProbe
    """A registered probe name, or an inline probe."""
    layer: Layer
    """Layer of the monitor site."""
    hook: Hook = "post_block"
    """Hook of the monitor site; the stream is read *before* this site's own steering."""
    threshold: FiniteFloat | None = None
    """Overrides the probe's threshold."""
    sharpness: Annotated[FiniteFloat, Field(gt=0)] | None = None
    """Overrides the probe's sharpness."""
    steer: list[SteerEntry] = Field(min_length=1, max_length=MAX_ENTRIES)
    """Entries scaled per token by the gate; their sites must be at or after the monitor."""
    trace: Annotated[bool, Field(strict=True)] = False
    """Keep the gate and score of every position for the telemetry report (``gates``);
    without it the report has the counters only (cheaper at high request rates)."""


class ControllerSpec(BaseModel):
    """A per-step controller of the request's gate (see
    :mod:`dynsteer.controller.controllers`): its name and its parameters, e.g.
    ``{"name": "latch", "k": 2}``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    """A built-in (``latch``, ``hysteresis``, ``proportional``, ``budget``) or a controller
    registered through the entry-point group ``dynsteer.controllers``."""

    def params(self) -> dict[str, Any]:
        """The parameters (every field but ``name``)."""
        return dict(self.model_extra or {})


SESSION_PATTERN = r"^[A-Za-z0-9_.:@/-]{1,256}$"

SINK_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
CaptureDtype = Literal["float32", "bfloat16", "float16", "int8"]


class RandomProjection(BaseModel):
    """A seeded random projection of captured rows to ``k`` dimensions (the matrix is
    :func:`dynsteer.controller.activations.projection_matrix`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k: Annotated[int, Field(strict=True, ge=1)]
    """Dimensions to keep (at most the model's hidden size)."""
    seed: Annotated[int, Field(strict=True, ge=0, lt=2**63)] = 0
    """Seed of the matrix (``numpy.random.default_rng(seed)``)."""


class CaptureSpec(BaseModel):
    """Activations of this request, returned with its output: the residual stream at some
    monitor sites, at the positions the engine computed for it (its prompt and every generated
    token but the last), read before each site's own steering."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sites: str | list[str]
    """Sites in the site grammar (``"post_block@12"``, ``["pre_attn@20", "post_block@*"]``);
    each must be a monitor site of the engine (``dynsteer.monitor_sites``)."""
    positions: Positions = "all"
    """``"prompt"``, ``"generated"``, ``"all"``, ``"last_prompt"``, or a list of positions and
    ``"a:b"`` ranges (negative indices count from the end of the prompt)."""
    dtype: CaptureDtype = "float32"
    """What the rows travel as; ``bfloat16`` / ``float16`` halve the bytes, ``int8`` (one
    float32 scale per row) quarters them."""
    project: RandomProjection | None = None
    """Project each row to ``k`` dimensions on the device before it is cast."""
    sink: Annotated[str, Field(pattern=SINK_PATTERN)] | None = None
    """A capture sink: one of the engine's (engine option ``capture_sinks``: the workers write
    the rows while the request runs) or of the server (``--dynsteer-capture-sinks``); the rows
    go there instead of into the output."""
    when: Literal["always", "gated"] = "always"
    """``gated``: keep the rows only if the request's gate fired (gate > 0.5 at some
    position); otherwise they are freed on the device and the status is ``skipped``. Needs a
    ``gate`` in the same spec."""
    window: tuple[Annotated[int, Field(ge=0, lt=2**31)],
                  Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    """With ``when: "gated"``: ``[before, after]``, keep only the positions from ``before``
    before the first position whose gate fired to ``after`` after it (of those ``positions``
    names); None: all of them."""
    reduce: Literal["mean"] | None = None
    """``mean``: one row per site, the mean of the rows at the positions captured (in float32
    on the device, before the projection and the cast), instead of one row per position; the
    positions still list those averaged. Not with a ``sink``."""

    @property
    def streams(self) -> bool:
        """Whether a streamed response carries the rows as they are computed: each row is
        final once computed (no gate to wait for, no mean over later rows) and the rows come
        back in the response (no sink)."""
        return self.when == "always" and self.reduce is None and self.sink is None

    @field_validator("window")
    @classmethod
    def _window_needs_a_gate(cls, window: tuple[int, int] | None,
                             info: ValidationInfo) -> tuple[int, int] | None:
        if window is not None and info.data.get("when") != "gated":
            raise ValueError("a window around the gate's first firing needs when: 'gated'")
        return window

    @field_validator("reduce")
    @classmethod
    def _reduce_is_returned(cls, reduce: str | None, info: ValidationInfo) -> str | None:
        if reduce is not None and info.data.get("sink") is not None:
            raise ValueError("a reduced capture is returned with the output; a sink stores "
                             "rows per position (drop reduce or sink)")
        return reduce


class SteeringSpec(BaseModel):
    """The whole per-request spec (version 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    """Schema version; only 1 exists."""
    steer: list[SteerEntry] = Field(default_factory=list, max_length=MAX_ENTRIES)
    """Static steering entries; they add to each other and to global steering."""
    gate: GateSpec | None = None
    """Optional probe-gated dynamic steering."""
    controller: ControllerSpec | None = None
    """Optional controller of the gate (needs ``gate``)."""
    session: Annotated[str, Field(pattern=SESSION_PATTERN)] | None = None
    """The conversation this request belongs to (what controllers see and act on across
    requests); 1-256 characters from A-Z a-z 0-9 _ . : @ / -."""
    capture: CaptureSpec | None = None
    """Activations to return with the output (``Steering.activations``)."""

    @model_validator(mode="after")
    def _few_cuts(self) -> SteeringSpec:
        entries = [*self.steer, *(self.gate.steer if self.gate is not None else ())]
        if sum(cuts(e.positions) for e in entries) > MAX_CUTS:
            raise ValueError(f"positions: the entries' positions split the request into more "
                             f"than {MAX_CUTS} stretches; merge them into fewer ranges")
        return self


@dataclass(frozen=True)
class ModelShape:
    """What a spec is checked against: one served model and its plugin configuration."""

    hidden_size: int
    num_layers: int
    sites: frozenset[tuple[Hook, int]]
    """Configured (hook, layer) sites; only these can be steered."""
    monitor_sites: frozenset[tuple[Hook, int]] | None = None
    """Sites a probe can read (None: every configured site)."""
    vector_norms: Mapping[str, float] = field(default_factory=dict)
    """Registered vectors by name: their L2 norm (what ``scale`` is checked against)."""
    probe_names: Collection[str] = ()
    max_steer_norm: float = DEFAULT_MAX_STEER_NORM
    """Largest ``‖scale · vector‖`` of one entry (engine option ``max_steer_norm``)."""
    max_projections: int = 0
    """Ablate / clamp entries one kind of token may have at one site (engine option
    ``max_projections``)."""
    dtype_max: float = FLOAT32_MAX
    """Largest finite value of the model's dtype."""
    missing_hook: Callable[[str], str | None] | None = None
    """Why the model's layers have no such hook, naming the layer class and its layout (None:
    they have it); asked only for a site that is not configured."""


def _field_path(loc: Iterable[Any], prefix: str) -> str:
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def validation_message(errors: Sequence[Any], prefix: str = "") -> str:
    """``field.path[i]: what is wrong`` for the first of pydantic's ``errors()`` (also used for
    the HTTP bodies of the dynsteer routes, so every way in words an error the same)."""
    first = next((e for e in errors if not _wrong_branch(e, errors)), errors[0])
    # Drop pydantic's union branch labels ("list[...]", "str") and FastAPI's "body".
    loc = [p for p in first["loc"] if not (isinstance(p, str) and _is_label(p))]
    message = float_error_message(first).removeprefix("Value error, ")
    # An error of the whole body (not an object, a model-level check) names the body.
    return f"{_field_path(loc, prefix).lstrip('.') or 'body'}: {message}"


def _is_label(part: str) -> bool:
    return "[" in part or part in ("str", "float", "body")


def _wrong_branch(error: Any, errors: Sequence[Any]) -> bool:
    """An error that only says the input is not of one union branch's type (``probe`` given as
    an object is not a string) while another branch reports what is wrong inside it."""
    loc = error["loc"]
    if not (loc and isinstance(loc[-1], str) and _is_label(loc[-1])
            and str(error["type"]).endswith("_type")):
        return False
    return any(other is not error and other["loc"][:len(loc) - 1] == loc[:-1]
               and len(other["loc"]) >= len(loc) for other in errors)


def _from_validation_error(err: ValidationError, prefix: str) -> SpecError:
    return SpecError(validation_message(err.errors(include_url=False), prefix))


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_DEPTH_CHUNK = 1 << 20


def json_depth(text: str | bytes, limit: int | None = None) -> int:
    """Deepest nesting of arrays and objects in JSON ``text`` (``[]`` is 1, a scalar 0).

    A byte scan, not a parse: strings (escaped quotes included) are skipped, brackets counted.
    With ``limit``, it stops once the depth exceeds ``limit``.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKET),
                             np.uint8)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        levels = np.cumsum(_BRACKET_STEP[brackets[start:start + _DEPTH_CHUNK]],
                           dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        if limit is not None and deepest > limit:
            break
    return deepest


def check_json_depth(text: str | bytes, prefix: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`SpecError` naming ``prefix`` when ``text`` nests deeper than ``limit``.

    Text with no more opening brackets than ``limit`` cannot nest deeper, and counting them
    is a memchr pass: the usual request (a prompt list, a spec, a base64 vector of tens of
    kB) never pays :func:`json_depth`'s string scan (about 150 µs for such a vector)."""
    openers = ("[", "{") if isinstance(text, str) else (b"[", b"{")
    if sum(text.count(c) for c in openers) <= limit:
        return
    if json_depth(text, limit) > limit:
        raise SpecError(f"{prefix}: JSON nested deeper than {limit} levels")


def _from_json_text(raw: Any, prefix: str) -> Any:
    """``raw`` decoded when it is JSON text (bounded depth; SpecError naming ``prefix``)."""
    if not isinstance(raw, (str, bytes)):
        return raw
    check_json_depth(raw, prefix)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise SpecError(f"{prefix}: malformed JSON ({e.msg} at position {e.pos})") from e
    except ValueError as e:  # not UTF-8, or an integer beyond Python's digit limit
        raise SpecError(f"{prefix}: malformed JSON ({e})") from e


def parse_spec(raw: Any, prefix: str = SPEC_KEY) -> SteeringSpec:
    """Parse a spec given as a dict, a JSON string or a :class:`SteeringSpec`."""
    if isinstance(raw, SteeringSpec):
        return raw
    raw = _from_json_text(raw, prefix)
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise SpecError(f"{prefix}: expected an object or its JSON string, got {kind}")
    try:
        return SteeringSpec.model_validate(raw)
    except ValidationError as e:
        raise _from_validation_error(e, prefix) from e


def parse_entries(raw: Any, prefix: str = "steer", positioned: bool = True
                  ) -> list[SteerEntry]:
    """Parse a list of steer entries (the body of global steering: ``positioned`` False
    refuses entries with ``positions``)."""
    raw = _from_json_text(raw, prefix)
    if not isinstance(raw, list):
        raise SpecError(f"{prefix}: expected a list of steer entries")
    if len(raw) > MAX_ENTRIES:
        raise SpecError(f"{prefix}: at most {MAX_ENTRIES} steer entries, got {len(raw)}")
    entries = []
    for i, item in enumerate(raw):
        if isinstance(item, SteerEntry):
            entries.append(item)
            continue
        try:
            entries.append(SteerEntry.model_validate(item))
        except ValidationError as e:
            raise _from_validation_error(e, f"{prefix}[{i}]") from e
    for i, entry in enumerate(entries):
        if not positioned and entry.positions is not None:
            raise SpecError(f"{prefix}[{i}].positions: global steering has no prompt to count "
                            "positions from; steer positions per request (or per session)")
    return entries


def parse_gate(raw: Any, prefix: str = "gate") -> GateSpec:
    """Parse a gate given as a dict or its JSON text (SpecError naming the field)."""
    raw = _from_json_text(raw, prefix)
    try:
        return GateSpec.model_validate(raw)
    except ValidationError as e:
        raise _from_validation_error(e, prefix) from e


def check_session(session: Any, prefix: str = "session") -> str:
    """A session name (SpecError naming ``prefix`` when it is not one)."""
    if not isinstance(session, str) or not re.fullmatch(SESSION_PATTERN.strip("^$"), session):
        raise SpecError(f"{prefix}: {session!r} is not a session name (1-256 characters from "
                        "A-Z a-z 0-9 _ . : @ / -)")
    return session


LISTED_NAMES = 8
"""How many registered names an unknown-name error lists (the list route has them all)."""


def _check_name(where: str, kind: str, name: str, known: Collection[str], fix: str) -> None:
    if name not in known:
        names = sorted(known)
        listed = ", ".join(names[:LISTED_NAMES]) or "none registered"
        if len(names) > LISTED_NAMES:
            listed += f", and {len(names) - LISTED_NAMES} more: GET /v1/dynsteer/{kind}s"
        raise SpecError(
            f"{where}: unknown {kind} name {name!r} (known: {listed}); register it first or {fix}"
        )


def _inline_values(where: str, item: SteerEntry | InlineProbe, shape: ModelShape) -> np.ndarray:
    """An entry's vector or a probe's weights, given as floats or base64, as a float32 vector
    of the hidden size that is finite in float32 (SpecError naming the field)."""
    field = "vector" if isinstance(item, SteerEntry) else "weights"
    floats = getattr(item, field)
    if floats is not None:  # the model already checked each float
        if len(floats) != shape.hidden_size:
            raise SpecError(f"{where}.{field}: expected {shape.hidden_size} floats (the "
                            f"model's hidden size), got {len(floats)}")
        return np.asarray(floats, dtype=np.float32)
    try:
        values = item.values()
    except SpecError as e:
        raise SpecError(f"{where}.{e}") from None
    return as_float32_vector(f"{where}.{field}_b64", values, shape.hidden_size)


def _check_site(where: str, hook: Hook, layer: int, shape: ModelShape, what: str = "") -> None:
    if layer >= shape.num_layers:
        raise SpecError(
            f"{where}: layer {layer} does not exist "
            f"(the model has layers 0..{shape.num_layers - 1})"
        )
    if (hook, layer) not in shape.sites:
        why = shape.missing_hook(hook) if shape.missing_hook else None
        if why:
            raise SpecError(f"{where}: {what}{missing_site((hook, layer), why)}")
        raise SpecError(f"{where}: {what}{unconfigured_site((hook, layer))}")


def check_entries(entries: Iterable[SteerEntry], shape: ModelShape, prefix: str) -> None:
    """Check entries against the served model; raise :class:`SpecError` on the first problem."""
    for i, entry in enumerate(entries):
        where = f"{prefix}[{i}]"
        if entry.name is not None:
            _check_name(f"{where}.vector", "vector", entry.name, shape.vector_norms,
                        "pass the floats inline")
            norm = shape.vector_norms[entry.name]
        else:
            vector = _inline_values(where, entry, shape)
            norm = float(np.linalg.norm(vector.astype(np.float64)))
        if entry.op == "add" and not entry.norm_match:
            check_steer_magnitude(where, norm, entry.scale, shape.max_steer_norm,
                                  shape.dtype_max)
        else:
            _check_slotted(where, entry, norm, shape)
        for layer in entry.layers:
            _check_site(f"{where}.layers", entry.hook, layer, shape)


MAX_NORM_MATCH_SCALE = 64.0
"""Largest ``|scale|`` of a ``norm_match`` entry: the added norm is ``|scale|`` times the
stream's."""


def _check_slotted(where: str, entry: SteerEntry, norm: float, shape: ModelShape) -> None:
    """An entry that takes a projection slot (ablate / clamp, or a ``norm_match`` add) is
    usable: the engine has projection slots, the vector has a direction, a clamp's target is
    within the steering bound and a norm-matched scale within its own."""
    field, what = ("norm_match", "norm_match") if entry.norm_match else ("op", f"op {entry.op!r}")
    if shape.max_projections == 0:
        raise SpecError(f"{where}.{field}: {what.removeprefix('op ')} needs the engine option "
                        "dynsteer.max_projections >= 1 (it is 0: start the engine with it)")
    if not norm > 0:
        raise SpecError(f"{where}.vector: {what} acts along the vector's direction, "
                        "and a zero vector has none")
    if entry.norm_match and abs(entry.scale) > MAX_NORM_MATCH_SCALE:
        raise SpecError(f"{where}.scale: {entry.scale} times the stream's norm; at most "
                        f"{MAX_NORM_MATCH_SCALE:g} with norm_match")
    if entry.value is not None:
        check_steer_magnitude(f"{where}.value", abs(entry.value), entry.scale,
                              shape.max_steer_norm, shape.dtype_max)


def check_projection_slots(steer: Sequence[SteerEntry], gated: Sequence[SteerEntry],
                           shape: ModelShape, prefix: str) -> None:
    """The ablate / clamp entries a kind of token gets at one site (a phase's own and gated
    entries together) fit the engine's ``max_projections`` slots."""
    for phase in ("prefill", "decode"):
        count: dict[tuple[str, int], int] = {}
        for entry in (*steer, *gated):
            takes_slot = entry.op in PROJECTIONS or entry.norm_match
            if takes_slot and entry.applies_to(phase):  # type: ignore[arg-type]
                for layer in entry.layers:
                    site = (entry.hook, layer)
                    count[site] = count.get(site, 0) + 1
                    if count[site] > shape.max_projections:
                        raise SpecError(
                            f"{prefix}: more than {shape.max_projections} ablate / clamp / "
                            f"norm_match entries steer {phase} tokens at ({entry.hook}, layer "
                            f"{layer}); raise dynsteer.max_projections or merge the directions")


def check_gate(gate: GateSpec, shape: ModelShape, prefix: str) -> None:
    """Check a gate against the served model (probe, monitor site, gated sites' order)."""
    if isinstance(gate.probe, str):
        _check_name(f"{prefix}.probe", "probe", gate.probe, shape.probe_names,
                    "give the weights inline")
    else:
        probe = gate.probe
        weights = _inline_values(f"{prefix}.probe", probe, shape)
        check_probe_numbers(f"{prefix}.probe.", probe.threshold, probe.sharpness, weights)
    check_probe_numbers(f"{prefix}.", gate.threshold or 0.0, gate.sharpness or 1.0)
    _check_site(f"{prefix}.layer", gate.hook, gate.layer, shape, what="monitor site ")
    if shape.monitor_sites is not None and (gate.hook, gate.layer) not in shape.monitor_sites:
        raise SpecError(f"{prefix}.layer: {unmonitored_site((gate.hook, gate.layer))}")
    check_entries(gate.steer, shape, f"{prefix}.steer")
    monitor = site_order(gate.hook, gate.layer)
    for i, entry in enumerate(gate.steer):
        for layer in entry.layers:
            if site_order(entry.hook, layer) < monitor:
                raise SpecError(
                    f"{prefix}.steer[{i}].layers: ({entry.hook}, layer {layer}) comes before the "
                    f"monitor site ({gate.hook}, layer {gate.layer}); gated steering must be at "
                    "or after the monitor"
                )


def check_controller(spec: SteeringSpec, prefix: str) -> dict[str, Any] | None:
    """The spec's controller as ``{"name", "params"}`` with its parameters validated (None:
    no controller); SpecError naming the field."""
    if spec.controller is None:
        return None
    from .controllers import controller_class, parse_params

    where = f"{prefix}.controller"
    if spec.gate is None:
        raise SpecError(f"{where}: a controller acts on the gate's probe scores; add "
                        f"{prefix}.gate")
    cls = controller_class(spec.controller.name, f"{where}.name")
    params = parse_params(cls, spec.controller.params(), where)
    return {"name": spec.controller.name, "params": params.model_dump(mode="json")}


def check_against_model(spec: SteeringSpec, shape: ModelShape, prefix: str = SPEC_KEY) -> None:
    """Check a parsed spec against the served model."""
    check_entries(spec.steer, shape, f"{prefix}.steer")
    if spec.gate is not None:
        check_gate(spec.gate, shape, f"{prefix}.gate")
    check_projection_slots(spec.steer, spec.gate.steer if spec.gate else (), shape, prefix)
    check_controller(spec, prefix)
    if spec.capture is not None:
        capture_sites(spec.capture, shape, f"{prefix}.capture")
        project = spec.capture.project
        if project is not None and project.k > shape.hidden_size:
            raise SpecError(f"{prefix}.capture.project.k: {project.k} is more than the model's "
                            f"hidden size ({shape.hidden_size})")
        if spec.capture.when == "gated" and spec.gate is None:
            raise SpecError(f"{prefix}.capture.when: 'gated' keeps the rows of a request whose "
                            "gate fired; add a gate to the spec, or capture 'always'")


def capture_sites(capture: CaptureSpec, shape: ModelShape, prefix: str) -> tuple[Site, ...]:
    """The sites a capture names, in forward order, each a monitor site (SpecError naming the
    field otherwise)."""
    try:
        sites = resolve_sites(capture.sites, shape.num_layers, f"{prefix}.sites")
    except ValueError as e:
        raise SpecError(str(e)) from e
    if not sites:
        raise SpecError(f"{prefix}.sites: names no site")
    monitors = shape.sites if shape.monitor_sites is None else shape.monitor_sites
    for site in sites:
        if site not in monitors:
            raise SpecError(f"{prefix}.sites: {unmonitored_site(site)}")
    return sites
