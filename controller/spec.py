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
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Hook = Literal["pre_attn", "post_attn", "post_block"]
"""Residual-stream sites of a decoder layer (TransformerLens: resid_pre, resid_mid, resid_post)."""

HOOKS: tuple[Hook, ...] = ("pre_attn", "post_attn", "post_block")

Phase = Literal["all", "prefill", "decode"]
"""``prefill``: prompt positions; ``decode``: generated positions; ``all``: both."""

SPEC_KEY = "dynsteer"
"""Key of the spec in ``SamplingParams.extra_args`` (and of the top-level body field)."""

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class SpecError(ValueError):
    """A steering spec that cannot be served; the message names the field and the fix."""


class SteerEntry(BaseModel):
    """One additive steering vector at one hook of some layers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vector: list[FiniteFloat] | str
    """The vector (hidden-size floats) or the name of a registered vector."""
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Decoder layers (0-based) to steer; each (layer, hook) must be a configured site."""
    hook: Hook = "post_block"
    """Where in the layer: ``pre_attn``, ``post_attn`` or ``post_block``."""
    scale: FiniteFloat = 1.0
    """Multiplier of the vector; ``0`` disables the entry."""
    phase: Phase = "all"
    """Which positions: prompt (``prefill``), generated (``decode``) or ``all``."""

    def applies_to(self, phase: Literal["prefill", "decode"]) -> bool:
        """Whether this entry steers tokens of ``phase``."""
        return self.phase in ("all", phase)


class InlineProbe(BaseModel):
    """A linear probe given inline in a request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: list[FiniteFloat] = Field(min_length=1)
    """Hidden-size weights; ``score = stream · weights`` (fp32 accumulate)."""
    threshold: FiniteFloat = 0.0
    """Score at which the gate is 0.5."""
    sharpness: FiniteFloat = Field(default=1.0, gt=0)
    """Slope of the sigmoid: ``gate = sigmoid(sharpness * (score - threshold))``."""


class GateSpec(BaseModel):
    """Probe-gated dynamic steering: the model's own activations decide, token by token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    probe: str | InlineProbe
    """A registered probe name, or an inline probe."""
    layer: Annotated[int, Field(ge=0)]
    """Layer of the monitor site."""
    hook: Hook = "post_block"
    """Hook of the monitor site; the stream is read *before* this site's own steering."""
    threshold: FiniteFloat | None = None
    """Overrides the probe's threshold."""
    sharpness: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    """Overrides the probe's sharpness."""
    steer: list[SteerEntry] = Field(min_length=1)
    """Entries scaled per token by the gate; their sites must be at or after the monitor."""


class SteeringSpec(BaseModel):
    """The whole per-request spec (version 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    """Schema version; only 1 exists."""
    steer: list[SteerEntry] = Field(default_factory=list)
    """Static steering entries; they add to each other and to global steering."""
    gate: GateSpec | None = None
    """Optional probe-gated dynamic steering."""


@dataclass(frozen=True)
class ModelShape:
    """What a spec is checked against: one served model and its plugin configuration."""

    hidden_size: int
    num_layers: int
    sites: frozenset[tuple[Hook, int]]
    """Configured (hook, layer) sites; only these have a kernel."""
    vector_names: Collection[str] = ()
    probe_names: Collection[str] = ()


def _field_path(loc: Iterable[Any], prefix: str) -> str:
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _from_validation_error(err: ValidationError, prefix: str) -> SpecError:
    first = err.errors(include_url=False)[0]
    loc = list(first["loc"])
    # Drop pydantic's union branch labels ("list[...]", "str") from the path.
    loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "float")))]
    return SpecError(f"{_field_path(loc, prefix)}: {first['msg']}")


def parse_spec(raw: Any, prefix: str = SPEC_KEY) -> SteeringSpec:
    """Parse a spec given as a dict, a JSON string or a :class:`SteeringSpec`."""
    if isinstance(raw, SteeringSpec):
        return raw
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecError(f"{prefix}: malformed JSON ({e.msg} at position {e.pos})") from e
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise SpecError(f"{prefix}: expected an object or its JSON string, got {kind}")
    try:
        return SteeringSpec.model_validate(raw)
    except ValidationError as e:
        raise _from_validation_error(e, prefix) from e


def parse_entries(raw: Any, prefix: str = "steer") -> list[SteerEntry]:
    """Parse a list of steer entries (the body of global steering)."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecError(f"{prefix}: malformed JSON ({e.msg} at position {e.pos})") from e
    if not isinstance(raw, list):
        raise SpecError(f"{prefix}: expected a list of steer entries")
    entries = []
    for i, item in enumerate(raw):
        if isinstance(item, SteerEntry):
            entries.append(item)
            continue
        try:
            entries.append(SteerEntry.model_validate(item))
        except ValidationError as e:
            raise _from_validation_error(e, f"{prefix}[{i}]") from e
    return entries


def _check_name(where: str, kind: str, name: str, known: Collection[str], fix: str) -> None:
    if name not in known:
        listed = ", ".join(sorted(known)) or "none registered"
        raise SpecError(
            f"{where}: unknown {kind} name {name!r} (known: {listed}); register it first or {fix}"
        )


def _check_length(where: str, values: list[float], shape: ModelShape) -> None:
    if len(values) != shape.hidden_size:
        raise SpecError(
            f"{where}: expected {shape.hidden_size} floats (the model's hidden size), "
            f"got {len(values)}"
        )


def _check_site(where: str, hook: Hook, layer: int, shape: ModelShape, what: str = "") -> None:
    if layer >= shape.num_layers:
        raise SpecError(
            f"{where}: layer {layer} does not exist "
            f"(the model has layers 0..{shape.num_layers - 1})"
        )
    if (hook, layer) not in shape.sites:
        raise SpecError(
            f"{where}: {what}({hook}, layer {layer}) is not a configured site; "
            f"add '{hook}@{layer}' to the engine option dynsteer.sites"
        )


def check_entries(entries: Iterable[SteerEntry], shape: ModelShape, prefix: str) -> None:
    """Check entries against the served model; raise :class:`SpecError` on the first problem."""
    for i, entry in enumerate(entries):
        where = f"{prefix}[{i}]"
        if isinstance(entry.vector, str):
            _check_name(f"{where}.vector", "vector", entry.vector, shape.vector_names,
                        "pass the floats inline")
        else:
            _check_length(f"{where}.vector", entry.vector, shape)
        for layer in entry.layers:
            _check_site(f"{where}.layers", entry.hook, layer, shape)


def site_key(hook: Hook, layer: int) -> tuple[int, int]:
    """Forward order of a site: layer first, then pre_attn < post_attn < post_block."""
    return layer, HOOKS.index(hook)


def check_gate(gate: GateSpec, shape: ModelShape, prefix: str) -> None:
    """Check a gate against the served model (probe, monitor site, gated sites' order)."""
    if isinstance(gate.probe, str):
        _check_name(f"{prefix}.probe", "probe", gate.probe, shape.probe_names,
                    "give the weights inline")
    else:
        _check_length(f"{prefix}.probe.weights", gate.probe.weights, shape)
    _check_site(f"{prefix}.layer", gate.hook, gate.layer, shape, what="monitor site ")
    check_entries(gate.steer, shape, f"{prefix}.steer")
    monitor = site_key(gate.hook, gate.layer)
    for i, entry in enumerate(gate.steer):
        for layer in entry.layers:
            if site_key(entry.hook, layer) < monitor:
                raise SpecError(
                    f"{prefix}.steer[{i}].layers: ({entry.hook}, layer {layer}) comes before the "
                    f"monitor site ({gate.hook}, layer {gate.layer}); gated steering must be at "
                    "or after the monitor"
                )


def check_against_model(spec: SteeringSpec, shape: ModelShape, prefix: str = SPEC_KEY) -> None:
    """Check a parsed spec against the served model."""
    check_entries(spec.steer, shape, f"{prefix}.steer")
    if spec.gate is not None:
        check_gate(spec.gate, shape, f"{prefix}.gate")
