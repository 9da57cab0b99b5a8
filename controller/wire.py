"""The resolved spec: what the frontend hands the workers, validated once and cheap to read.

A client's spec (JSON floats, base64, names) is parsed and checked once, in the process that
admits the request (:mod:`dynsteer.controller.spec`). What travels on to the engine core and
every worker is this form, in ``SamplingParams.extra_args[WIRE_KEY]`` (:mod:`.extra_args`):
plain lists, numbers, strings and ``bytes`` (vLLM's msgpack carries them as they are), with
vectors as little-endian float32 bytes, so a worker builds its rows with ``np.frombuffer`` and
no JSON or pydantic work, and the prefix-cache fingerprint hashes bytes, not decimal text.

Layout (positional, so msgpack stays small):

* entry: ``[hook, layers, phase, scale, vector, op, value, positions, norm_match]``
  (:data:`RawEntry`; readers take it through :class:`WireEntry`'s named fields,
  :func:`read_entries`), ``vector`` = float32 bytes or a registered vector's name, ``op`` =
  ``add``, ``ablate`` or ``clamp``, ``value`` = the clamp's target (None for the others),
  ``positions`` = the spec's (None: every position), ``norm_match`` = a bool;
* spec: ``{"steer": [entry...], "gate": gate or None, "controller": {"name", "params"} or
  None, "key": hex, "session": str or None}``; ``key`` is a content hash of everything but the
  session, so workers can reuse what they built for an identical spec and the prefix-cache
  fingerprint hashes a few bytes per request;
* gate: ``{"probe", "hook", "layer", "threshold", "sharpness", "steer": [entry...], "trace"}``,
  ``probe`` = a registered probe's name or ``[weights bytes, threshold, sharpness]``
  (:data:`WireProbe`, also what registering a probe sends the workers);
  ``threshold`` / ``sharpness`` are the request's overrides (None: the probe's).

No vLLM import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .contract import F32, f32_bytes
from .spec import GateSpec, SteerEntry, SteeringSpec, check_controller

__all__ = ["F32", "RawEntry", "WireEntry", "WireProbe", "entry_to_wire", "fingerprint",
           "gate_to_wire", "probe_to_wire", "read_entries", "spec_to_wire"]

RawEntry = list[Any]
"""An entry as it travels: :class:`WireEntry`'s fields, in its order, as a plain list."""


class WireEntry(NamedTuple):
    """One steering entry, resolved: how every reader takes a :data:`RawEntry`."""

    hook: str
    layers: list[int]
    phase: str
    """``all``, ``prefill`` or ``decode``."""
    scale: float
    vector: bytes | str
    """float32 bytes, or a registered vector's name."""
    op: str
    """``add``, ``ablate`` or ``clamp``."""
    value: float | None
    """The clamp's target (None for the others)."""
    positions: Any = None
    """The entry's ``positions`` as the spec gives them (None: every position; see
    :mod:`.positions`)."""
    norm_match: bool = False
    """An ``add`` scaled to the stream's norm at each token (see the spec)."""


def read_entries(raw: Iterable[Sequence[Any]]) -> list[WireEntry]:
    """Raw entries (lists, as msgpack delivers them) through their named fields (trailing
    fields an entry lacks take their defaults)."""
    return [WireEntry(*e) for e in raw]

WireProbe = list[Any]
"""``[weights bytes, threshold, sharpness]``: an inline probe, and what a worker is sent when a
probe is registered."""


def entry_to_wire(entry: SteerEntry) -> RawEntry:
    vector = entry.name if entry.name is not None else f32_bytes(entry.values())
    return list(WireEntry(entry.hook, list(entry.layers), entry.phase, float(entry.scale), vector,
                          entry.op, None if entry.value is None else float(entry.value),
                          entry.positions, entry.norm_match))


def probe_to_wire(weights: Any, threshold: float, sharpness: float) -> WireProbe:
    """A checked probe's numbers in the resolved form (see :data:`WireProbe`)."""
    return [f32_bytes(weights), float(threshold), float(sharpness)]


def gate_to_wire(gate: GateSpec) -> dict[str, Any]:
    probe: Any = gate.probe
    if not isinstance(probe, str):
        probe = probe_to_wire(probe.values(), probe.threshold, probe.sharpness)
    return {"probe": probe, "hook": gate.hook, "layer": gate.layer,
            "threshold": gate.threshold, "sharpness": gate.sharpness,
            "steer": [entry_to_wire(e) for e in gate.steer], "trace": gate.trace}


def spec_to_wire(spec: SteeringSpec) -> dict[str, Any]:
    wire = {"steer": [entry_to_wire(e) for e in spec.steer],
            "gate": gate_to_wire(spec.gate) if spec.gate is not None else None,
            "controller": check_controller(spec, "dynsteer")}
    wire["key"] = fingerprint(wire).hex()
    wire["session"] = spec.session
    return wire


def fingerprint(*parts: Any) -> bytes:
    """A content hash of wire values (entries, specs, names): bytes hash as bytes."""
    h = hashlib.blake2b(digest_size=12)

    def feed(value: Any) -> None:
        if isinstance(value, bytes):
            h.update(b"b%d:" % len(value))
            h.update(value)
        elif isinstance(value, dict):
            for key in sorted(value):
                h.update(f"k{key}:".encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(b"[%d" % len(value))
            for item in value:
                feed(item)
            h.update(b"]")
        else:
            h.update(f"{type(value).__name__}:{value!r};".encode())

    for part in parts:
        feed(part)
    return h.digest()
