"""Control-plane changes, validated once and applied by a sync or an async driver.

Every change (register a vector, set global steering, ...) is first checked against the served
model in the frontend, with the same messages as per-request specs, and turned into a
:class:`Change`: the worker RPC that applies it on every TP rank (``collective_rpc``, so all
ranks change in the same order) and the frontend update to make once the RPC succeeded. The
RPC carries the checked values in the resolved form of :mod:`dynsteer.controller.wire` (float32
bytes, numbers, names), which the workers apply without checking or parsing again. The
offline API (:class:`.offline_api.Steering`) runs changes with the blocking
``LLM.collective_rpc``; the HTTP routes run the same changes with ``AsyncLLM.collective_rpc``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from dynsteer.controller.contract import NAME_PATTERN, NAME_RULE, f32_bytes, unmonitored_site
from dynsteer.controller.limits import (
    as_float32_vector,
    check_probe_numbers,
    check_steer_magnitude,
)
from dynsteer.controller.spec import (
    GateSpec,
    SteerEntry,
    check_entries,
    check_gate,
    check_projection_slots,
    parse_entries,
)
from dynsteer.controller.wire import entry_to_wire, fingerprint, gate_to_wire, probe_to_wire
from dynsteer.probes import Probe

from .admission import FrontendState


class ControlError(ValueError):
    """A change that cannot be applied; the message starts with the field at fault."""


class UnknownNameError(ControlError, KeyError):
    """The named vector or probe does not exist (HTTP 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ConflictError(ControlError):
    """The name is taken (and replacing was not asked for) or the registry is full (HTTP 409)."""


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ControlError(f"{field}: {name!r} is not a valid name (use {NAME_RULE})")
    return name


def _number(field: str, value: Any) -> float:
    """A real number given to the Python API, as a float (ControlError naming the field)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ControlError(f"{field}: expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ControlError(f"{field}: {value!r} is out of range") from None


def _entry_list(field: str, entries: Any) -> list[Any]:
    """A list of steering entries given to the Python API (ControlError naming the field)."""
    if not isinstance(entries, (list, tuple)):
        raise ControlError(f"{field}: expected a list of entries, got {type(entries).__name__}")
    return list(entries)


def _check_room(kind: str, name: str, registry: dict[str, Any], limit: int, option: str,
                replace: bool) -> None:
    """A new name fits in a registry of at most ``limit``; a taken one needs ``replace``."""
    if name in registry:
        if not replace:
            raise ConflictError(f"name: a {kind} named {name!r} is already registered; "
                                "replace it explicitly (replace=true) or pick another name")
    elif len(registry) >= limit:
        raise ConflictError(f"name: {len(registry)} {kind}s are registered, the limit "
                            f"(engine option dynsteer.{option}); delete one or raise the limit")


@dataclass(frozen=True)
class Change:
    """One validated change: the worker RPC to run, then the frontend update (``commit``)."""

    method: str
    args: tuple[Any, ...]
    update: Callable[[], None]
    registry: FrontendState | None = None
    """Set for a change of the named vectors and probes: it makes a new registry generation of
    this frontend, which the RPC carries and ``commit`` moves the frontend to."""

    def rpc_args(self) -> tuple[Any, ...]:
        """The worker RPC's arguments; a registry change's end with the generation it creates.
        Call this, the RPC and :meth:`commit` under the lock that orders changes, so requests
        admitted before the commit (under the old generation, which the workers keep) and
        after it (the new one) resolve their names as they were checked."""
        if self.registry is None:
            return self.args
        return (*self.args, self.registry.registry_generation + 1)

    def commit(self) -> None:
        """Update the frontend once every worker applied the RPC."""
        self.update()
        if self.registry is not None:
            self.registry.registry_generation += 1


class ControlPlane:
    """Builds validated :class:`Change`\\ s for one engine's frontend state."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend

    def register_vector(self, name: str, vector: Sequence[float] | np.ndarray,
                        replace: bool = False) -> Change:
        """Register a named vector usable as ``"vector": name`` in specs (an existing name
        only with ``replace``); checked like an inline vector of scale 1."""
        f = self.frontend
        check_name(name)
        array = as_float32_vector("vector", vector, f.hidden_size)
        norm = float(np.linalg.norm(array.astype(np.float64)))
        check_steer_magnitude("vector", norm, 1.0, f.options.max_steer_norm, f.dtype_max)
        _check_room("vector", name, f.vectors, f.options.max_vectors, "max_vectors", replace)
        array.setflags(write=False)

        def commit() -> None:
            f.vectors[name] = array
            f.vector_norms[name] = norm

        return Change("dynsteer_register_vector", (name, f32_bytes(array)), commit, registry=f)

    def unregister_vector(self, name: str) -> Change:
        """Forget a named vector; requests already admitted keep their steering."""
        return self._forget("vector", name, self.frontend.vectors, self.frontend.vector_norms)

    def register_probe(self, name: str, weights: Sequence[float] | np.ndarray, threshold: float,
                       sharpness: float, replace: bool = False,
                       probe: Probe | None = None) -> Change:
        """Register a named probe usable as ``"probe": name`` in a gate (an existing name only
        with ``replace``); checked like an inline probe.

        ``probe``: the :class:`~dynsteer.probes.Probe` these numbers come from (what listing
        routes return); see :meth:`register_probe_object`.
        """
        f = self.frontend
        check_name(name)
        array = as_float32_vector("weights", weights, f.hidden_size)
        threshold, sharpness = _number("threshold", threshold), _number("sharpness", sharpness)
        check_probe_numbers("", threshold, sharpness, array)
        _check_room("probe", name, f.probes, f.options.max_probes, "max_probes", replace)

        def commit() -> None:
            f.probes[name] = probe

        return Change("dynsteer_register_probe",
                      (name, probe_to_wire(array, threshold, sharpness)), commit, registry=f)

    def register_probe_object(self, probe: Probe, replace: bool = False) -> Change:
        """Register a :class:`~dynsteer.probes.Probe` under its name, after checking that it
        was trained on this model (fingerprint) at a site this engine monitors."""
        problems = probe.incompatibilities(self.frontend.model())
        if problems:
            raise ControlError("; ".join(problems))
        site = (probe.site.hook, probe.site.layer)
        if site not in self.frontend.monitors:
            raise ControlError(f"site: {unmonitored_site(site)}")
        return self.register_probe(probe.name, probe.weights, probe.threshold, probe.sharpness,
                                   replace=replace, probe=probe)

    def unregister_probe(self, name: str) -> Change:
        """Forget a named probe; requests already admitted keep their gate."""
        return self._forget("probe", name, self.frontend.probes)

    def _forget(self, kind: str, name: str, *registries: dict[str, Any]) -> Change:
        """Remove ``name`` from ``registries`` (the first one lists the registered names)."""
        check_name(name)
        if name not in registries[0]:
            raise UnknownNameError(f"name: unknown {kind} {name!r}")

        def commit() -> None:
            for registry in registries:
                registry.pop(name, None)

        return Change(f"dynsteer_unregister_{kind}", (name,), commit, registry=self.frontend)

    def set_global(self, entries: Sequence[SteerEntry | dict[str, Any]]) -> Change:
        """Steer every request admitted from now on with ``entries`` (added to its own
        steering); requests in flight keep the global steering they were admitted under."""
        parsed = parse_entries(_entry_list("steer", entries), prefix="steer", positioned=False)
        shape = self.frontend.shape()
        check_entries(parsed, shape, prefix="steer")
        check_projection_slots(parsed, (), shape, prefix="steer")
        shown = [e.model_dump(exclude_none=True) for e in parsed]
        wire = [entry_to_wire(e) for e in parsed]
        key = fingerprint(wire).hex() if wire else None

        def commit() -> None:
            self.frontend.set_global(shown, wire, key)

        return Change("dynsteer_set_global", (wire, key or "-"), commit)

    def clear_global(self) -> Change:
        """Remove global steering."""
        return self.set_global([])

    def update_probe(self, name: str, threshold: float, sharpness: float | None = None
                     ) -> Change:
        """Change a registered probe's threshold (and sharpness) for requests admitted from
        now on (admitted ones keep theirs)."""
        f = self.frontend
        check_name(name)
        if name not in f.probes:
            raise UnknownNameError(f"name: unknown probe {name!r}")
        threshold = _number("threshold", threshold)
        sharpness = None if sharpness is None else _number("sharpness", sharpness)
        check_probe_numbers("", threshold, 1.0 if sharpness is None else sharpness)

        def commit() -> None:
            probe = f.probes[name]
            if probe is not None:
                changes = {"threshold": float(threshold)}
                if sharpness is not None:
                    changes["sharpness"] = float(sharpness)
                f.probes[name] = probe.replace(**changes)

        return Change("dynsteer_update_probe", (name, threshold, sharpness), commit, registry=f)

    def session_steering(self, steer: Sequence[SteerEntry | dict[str, Any]],
                         gate: GateSpec | None) -> dict[str, Any]:
        """Steering for a session's later requests, checked against the served model like a
        request's own, in the form :meth:`.admission.FrontendState.set_session` keeps."""
        shape = self.frontend.shape()
        entries = parse_entries(_entry_list("steer", steer), prefix="steer")
        check_entries(entries, shape, prefix="steer")
        if gate is not None:
            check_gate(gate, shape, "gate")
        check_projection_slots(entries, gate.steer if gate else (), shape, "steer")
        return {"steer": [entry_to_wire(e) for e in entries],
                "gate": gate_to_wire(gate) if gate is not None else None}
