"""Control-plane changes, validated once and applied by a sync or an async driver.

Every change (register a vector, set global steering, ...) is first checked against the served
model in the frontend, with the same messages as per-request specs, and turned into a
:class:`Change`: the worker RPC that applies it on every TP rank (``collective_rpc``, so all
ranks change in the same order) and the frontend update to make once the RPC succeeded. The
offline API (:class:`dynsteer.engine_ext.api.Steering`) runs changes with the blocking
``LLM.collective_rpc``; the HTTP routes run the same changes with ``AsyncLLM.collective_rpc``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynsteer.controller.spec import SteerEntry, check_entries, parse_entries
from dynsteer.engine_ext.frontend import FrontendState
from dynsteer.probes import ModelFingerprint, Probe

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Names of vectors and probes (safe as file names and URL path segments)."""


class ControlError(ValueError):
    """A change that cannot be applied; the message starts with the field at fault."""


class UnknownNameError(ControlError, KeyError):
    """The named vector or probe does not exist (HTTP 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ControlError(f"{field}: {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
    return name


def checked_vector(field: str, values: Sequence[float] | np.ndarray, hidden: int) -> list[float]:
    """A hidden-size finite vector as a JSON-able list, or a ControlError naming ``field``."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ControlError(f"{field}: expected {hidden} floats ({e})") from e
    if array.shape != (hidden,):
        raise ControlError(
            f"{field}: expected {hidden} floats (the model's hidden size), got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ControlError(f"{field}: contains NaN or inf")
    return array.tolist()


@dataclass(frozen=True)
class Change:
    """One validated change: the worker RPC to run, then the frontend update."""

    method: str
    args: tuple[Any, ...]
    commit: Callable[[], None]


class ControlPlane:
    """Builds validated :class:`Change`\\ s for one engine's frontend state."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend

    def register_vector(self, name: str, vector: Sequence[float] | np.ndarray) -> Change:
        """Register (or replace) a named vector usable as ``"vector": name`` in specs."""
        check_name(name)
        values = checked_vector("vector", vector, self.frontend.hidden_size)

        def commit() -> None:
            self.frontend.vectors[name] = values
            self.frontend.registry_generation += 1

        return Change("dynsteer_register_vector", (name, values), commit)

    def unregister_vector(self, name: str) -> Change:
        """Forget a named vector; requests already admitted keep their steering."""
        if name not in self.frontend.vectors:
            raise UnknownNameError(f"name: unknown vector {name!r}")

        def commit() -> None:
            self.frontend.vectors.pop(name, None)
            self.frontend.registry_generation += 1

        return Change("dynsteer_unregister_vector", (name,), commit)

    def register_probe(self, name: str, weights: Sequence[float] | np.ndarray, threshold: float,
                       sharpness: float, description: dict[str, Any] | None = None) -> Change:
        """Register (or replace) a named probe usable as ``"probe": name`` in a gate.

        ``description`` (the probe's JSON form, weights included) is what listing routes return.
        """
        check_name(name)
        values = checked_vector("weights", weights, self.frontend.hidden_size)
        if not np.isfinite(threshold):
            raise ControlError("threshold: must be finite")
        if not (np.isfinite(sharpness) and sharpness > 0):
            raise ControlError("sharpness: must be finite and > 0")
        info = dict(description or {})
        info.update(name=name, threshold=float(threshold), sharpness=float(sharpness))

        def commit() -> None:
            self.frontend.probes[name] = info
            self.frontend.registry_generation += 1

        return Change("dynsteer_register_probe", (name, values, float(threshold),
                                                  float(sharpness)), commit)

    def register_probe_object(self, probe: Probe) -> Change:
        """Register a :class:`~dynsteer.probes.Probe` under its name, after checking that it
        was trained on this model (fingerprint) at a site this engine monitors."""
        f = self.frontend
        hook, layer = probe.site.hook, probe.site.layer
        if layer >= f.num_layers:
            raise ControlError(f"site.layer: {layer} does not exist (the model has "
                               f"{f.num_layers} layers)")
        if (hook, layer) not in f.sites:
            raise ControlError(f"site: {hook}@{layer} is not a configured site; configured: "
                               f"{', '.join(f.site_names())} (engine option dynsteer.sites)")
        if probe.fingerprint is not None:
            served = ModelFingerprint(architecture=f.architecture or "unknown",
                                      hidden_size=f.hidden_size, num_layers=f.num_layers)
            problems = probe.fingerprint.mismatches(served)
            if problems:
                raise ControlError("fingerprint: " + "; ".join(problems))
        return self.register_probe(probe.name, probe.weights, probe.threshold, probe.sharpness,
                                   probe.to_json_dict())

    def unregister_probe(self, name: str) -> Change:
        """Forget a named probe; requests already admitted keep their gate."""
        if name not in self.frontend.probes:
            raise UnknownNameError(f"name: unknown probe {name!r}")

        def commit() -> None:
            self.frontend.probes.pop(name, None)
            self.frontend.registry_generation += 1

        return Change("dynsteer_unregister_probe", (name,), commit)

    def set_global(self, entries: Sequence[SteerEntry | dict[str, Any]]) -> Change:
        """Steer every request with ``entries`` (added to each request's own steering)."""
        parsed = parse_entries(list(entries), prefix="steer")
        check_entries(parsed, self.frontend.shape(), prefix="steer")
        payload = [e.model_dump() for e in parsed]

        def commit() -> None:
            self.frontend.global_entries = payload

        return Change("dynsteer_set_global", (payload,), commit)

    def clear_global(self) -> Change:
        """Remove global steering."""
        return self.set_global([])
