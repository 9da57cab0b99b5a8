"""What a request's rows hold, from the wire form of its spec: pure numpy, no device.

The frontend checked and resolved the spec (:mod:`dynsteer.controller.wire`: bytes and numbers);
here its entries become per-phase row *contents* (a vector to add per site, ungated and gated)
and *projections* (the ablate / clamp entries per site, in order), and its gate a probe placed at
a monitor site. Kept apart from the tables that hold the results so that every rule of the wire
form (phases, zero scales, named vectors, projection directions, probe overrides, a controller's
switch) is checked by unit tests without an engine.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dynsteer.controller.contract import Site, site_name
from dynsteer.controller.controllers import Action
from dynsteer.controller.wire import F32, RawEntry, WireProbe, read_entries

PHASES: tuple[Literal["prefill"], Literal["decode"]] = ("prefill", "decode")

Contents = dict[Site, np.ndarray]
"""What a row adds at each site (float32 vectors of hidden size); absent sites add zero."""


@dataclass(frozen=True)
class Projection:
    """One ablate / clamp entry (or norm-matched add) at one site: the stream ``z`` becomes
    ``z + (static + gate * gated) * (value - z·direction) * direction``."""

    direction: np.ndarray
    """float32 unit vector."""
    static: float
    gated: float
    value: float
    norm: bool = False
    """A norm-matched add: ``z + (static + gate * gated) * ‖z‖ * direction`` instead."""


Projections = dict[Site, tuple[Projection, ...]]
"""A row's projections per site, in the order they apply."""


@dataclass(frozen=True)
class ProbeRow:
    """A probe placed at a monitor site."""

    weights: np.ndarray
    threshold: float
    sharpness: float
    site: Site


def add_projections(a: Projections, b: Projections) -> Projections:
    """``a``'s projections, then ``b``'s, per site."""
    out = dict(a)
    for site, items in b.items():
        out[site] = out.get(site, ()) + items
    return out


def add_contents(a: Contents, b: Contents) -> Contents:
    """Sum of two row contents."""
    out = {site: vec.copy() for site, vec in a.items()}
    for site, vec in b.items():
        out[site] = out[site] + vec if site in out else vec.copy()
    return out


def static_only(projections: Projections) -> Projections:
    """``projections`` without the gated ones (for a request whose gate has no probe row)."""
    kept = {site: tuple(p for p in items if p.static) for site, items in projections.items()}
    return {site: items for site, items in kept.items() if items}


@dataclass(frozen=True)
class Resolved:
    """What a resolved spec builds (the same for every request that carries it)."""

    own: dict[str, Contents]
    """Static adds per phase."""
    gated: dict[str, Contents]
    """Adds scaled by the gate, per phase."""
    projections: dict[str, Projections]
    """Ablate / clamp entries per phase: the static ones, then the gated ones."""
    probe: ProbeRow | None
    trace: bool

    def dynamic(self, phase: str) -> bool:
        """Whether tokens of ``phase`` are steered by the gate (gated adds or projections)."""
        return bool(self.gated[phase]) or any(
            p.gated for items in self.projections[phase].values() for p in items)


def _per_phase() -> dict[str, Any]:
    return {p: {} for p in PHASES}


UNSTEERED = Resolved(own=_per_phase(), gated=_per_phase(), projections=_per_phase(), probe=None,
                     trace=False)


def entry_contents(entries: list[RawEntry], vectors: Mapping[str, np.ndarray], hidden_size: int,
                   gated: bool = False) -> tuple[dict[str, Contents], dict[str, Projections]]:
    """The entries' adds and projections per phase (``gated``: their coefficient is the
    gate's), named vectors taken from ``vectors``. Entries of scale 0 contribute nothing."""
    adds: dict[str, Contents] = _per_phase()
    projections: dict[str, Projections] = _per_phase()
    for entry in read_entries(entries):
        if entry.scale == 0:
            continue
        vec = entry.vector
        values = vectors[vec] if isinstance(vec, str) else np.frombuffer(vec, dtype=F32)
        if values.shape != (hidden_size,):
            raise ValueError(f"vector length {values.shape[0]} != hidden {hidden_size}")
        phases = [p for p in PHASES if entry.phase in ("all", p)]
        if entry.op == "add" and not entry.norm_match:
            scaled = values * np.float32(entry.scale)
            part = {(entry.hook, layer): scaled for layer in entry.layers}
            for phase in phases:
                adds[phase] = add_contents(adds[phase], part)
            continue
        norm = float(np.linalg.norm(values.astype(np.float64)))
        if not 0 < norm < np.inf:
            raise ValueError(f"op {entry.op!r} (or norm_match) needs a vector with a direction")
        scale = float(entry.scale)
        item = (Projection(direction=(values / norm).astype(F32),
                           static=0.0 if gated else scale, gated=scale if gated else 0.0,
                           value=entry.value or 0.0, norm=entry.op == "add"),)
        for phase in phases:
            projections[phase] = add_projections(
                projections[phase], {(entry.hook, layer): item for layer in entry.layers})
    return adds, projections


def resolve_probe(gate: dict[str, Any], probes: Mapping[str, WireProbe], hidden_size: int,
                  monitor_sites: Collection[Site]) -> ProbeRow:
    """The gate's probe (inline, or registered by name) at the gate's site, with the gate's
    own threshold and sharpness where it sets them."""
    probe = gate["probe"]
    raw, threshold, sharpness = probes[probe] if isinstance(probe, str) else probe
    weights = np.frombuffer(raw, dtype=F32)
    if weights.shape != (hidden_size,):
        raise ValueError(f"probe length {weights.shape[0]} != hidden {hidden_size}")
    site = (gate["hook"], gate["layer"])
    if site not in monitor_sites:
        raise ValueError(f"{site_name(site)} is not a monitor site")
    return ProbeRow(
        weights=weights,
        threshold=gate["threshold"] if gate["threshold"] is not None else threshold,
        sharpness=gate["sharpness"] if gate["sharpness"] is not None else sharpness,
        site=site,
    )


def resolve(wire: dict[str, Any], vectors: Mapping[str, np.ndarray],
            probes: Mapping[str, WireProbe], hidden_size: int,
            monitor_sites: Collection[Site]) -> Resolved:
    """What a resolved spec builds with the given named vectors and probes. Raises
    ``ValueError`` / ``KeyError`` where it cannot be served (a wrong length, a name no longer
    registered, a gate away from the monitor sites)."""
    gate = wire["gate"]
    own, own_projections = entry_contents(wire["steer"], vectors, hidden_size)
    if gate is None:
        return Resolved(own=own, gated=UNSTEERED.gated, projections=own_projections,
                        probe=None, trace=False)
    gated, gated_projections = entry_contents(gate["steer"], vectors, hidden_size, gated=True)
    return Resolved(
        own=own, gated=gated,
        projections={p: add_projections(own_projections[p], gated_projections[p])
                     for p in PHASES},
        probe=resolve_probe(gate, probes, hidden_size, monitor_sites),
        trace=bool(gate["trace"]),
    )


def switched(wire: dict[str, Any], key: str, action: Action, name: str | None,
             vectors: Collection[str], probes: Collection[str]) -> dict[str, Any]:
    """The spec a gated request continues with after a controller's switch: its gated entries
    steer with registered vector ``name`` (``SWITCH_VECTOR``), its gate reads registered probe
    ``name`` (``SWITCH_PROBE``), or its own steering ends (``STOP``). ``key``: the request's
    current key, extended so the result never shares rows or cached resolutions with a spec
    sent as is. Unknown names raise ``KeyError``."""
    wire, gate = dict(wire), dict(wire["gate"])
    if action == Action.SWITCH_VECTOR:
        if name not in vectors:
            raise KeyError(f"no registered vector {name!r}")
        gate["steer"] = [list(e._replace(vector=name)) for e in read_entries(gate["steer"])]
    elif action == Action.SWITCH_PROBE:
        if name not in probes:
            raise KeyError(f"no registered probe {name!r}")
        gate.update(probe=name, threshold=None, sharpness=None)
    else:
        wire["steer"] = []
        gate["steer"] = []
    wire["gate"] = gate
    wire["key"] = f"{key}|{action.name}:{name}"
    return wire
