"""Python API on a running offline ``LLM``: global steering and named vectors.

Every call is validated in the frontend first (same checks and messages as per-request specs)
and then applied on every worker through ``collective_rpc``, so all TP ranks stay identical.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from dynsteer.controller.spec import SteerEntry, check_entries, parse_entries
from dynsteer.engine_ext import compat

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"name: {name!r} must match [A-Za-z0-9_.-]{{1,64}}")


def _checked_vector(field: str, values: Sequence[float] | np.ndarray, hidden: int) -> list[float]:
    """A hidden-size finite vector as a JSON-able list, or a ValueError naming ``field``."""
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (hidden,):
        raise ValueError(
            f"{field}: expected {hidden} floats (the model's hidden size), got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ValueError(f"{field}: contains NaN or inf")
    return array.tolist()


class Steering:
    """Control plane of one engine started with ``additional_config={"dynsteer": {...}}``."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        frontend = compat.frontend_state(compat.input_processor_of(llm))
        if frontend is None:
            raise RuntimeError(
                "dynsteer is not enabled on this engine: pass additional_config={'dynsteer': {}}"
            )
        self._frontend = frontend

    @property
    def sites(self) -> list[str]:
        """Configured sites, ``hook@layer``, in forward order."""
        return [f"{hook}@{layer}" for hook, layer in self._frontend.sites]

    @property
    def hidden_size(self) -> int:
        return self._frontend.hidden_size

    def register_vector(self, name: str, vector: Sequence[float] | np.ndarray) -> None:
        """Register (or replace) a named vector usable as ``"vector": name`` in specs."""
        _check_name(name)
        values = _checked_vector("vector", vector, self.hidden_size)
        self._llm.collective_rpc("dynsteer_register_vector", args=(name, values))
        self._frontend.vector_names.add(name)
        self._frontend.registry_generation += 1

    def unregister_vector(self, name: str) -> None:
        """Forget a named vector; requests already admitted keep their steering."""
        if name not in self._frontend.vector_names:
            raise ValueError(f"name: unknown vector {name!r}")
        self._llm.collective_rpc("dynsteer_unregister_vector", args=(name,))
        self._frontend.vector_names.discard(name)
        self._frontend.registry_generation += 1

    def vectors(self) -> list[str]:
        """Names of the registered vectors."""
        return sorted(self._frontend.vector_names)

    def register_probe(self, name: str, probe: Any = None, *, weights: Any = None,
                       threshold: float = 0.0, sharpness: float = 1.0) -> None:
        """Register (or replace) a named probe usable as ``"probe": name`` in a gate.

        Pass a :class:`dynsteer.probes.Probe` (its weights, threshold and sharpness are used) or
        ``weights=`` with ``threshold``/``sharpness``. The monitor site comes from each
        request's gate (``layer``/``hook``).
        """
        _check_name(name)
        if probe is not None:
            weights, threshold, sharpness = probe.weights, probe.threshold, probe.sharpness
        values = _checked_vector("weights", weights, self.hidden_size)
        if not (np.isfinite(threshold) and np.isfinite(sharpness) and sharpness > 0):
            raise ValueError("threshold must be finite and sharpness finite and > 0")
        self._llm.collective_rpc(
            "dynsteer_register_probe",
            args=(name, values, float(threshold), float(sharpness)),
        )
        self._frontend.probe_names.add(name)
        self._frontend.registry_generation += 1

    def unregister_probe(self, name: str) -> None:
        """Forget a named probe; requests already admitted keep their gate."""
        if name not in self._frontend.probe_names:
            raise ValueError(f"name: unknown probe {name!r}")
        self._llm.collective_rpc("dynsteer_unregister_probe", args=(name,))
        self._frontend.probe_names.discard(name)
        self._frontend.registry_generation += 1

    def probes(self) -> list[str]:
        """Names of the registered probes."""
        return sorted(self._frontend.probe_names)

    def telemetry(self, output: Any) -> dict[str, Any] | None:
        """Gate telemetry of a request (a ``RequestOutput`` or its id), None if it had no gate.

        Keys: ``tokens_monitored``, ``gated_prefill`` / ``gated_decode`` (tokens with gate >
        0.5), ``first_decode_gated`` (0-based index of the first generated position gated, or
        None), ``max_score`` and ``gates`` (per position, None where not processed).
        """
        request_id = output if isinstance(output, str) else output.request_id
        return self._llm.collective_rpc("dynsteer_telemetry", args=(request_id,))[0]

    def set_global(self, entries: Sequence[SteerEntry | dict[str, Any]]) -> None:
        """Steer every request with ``entries`` (added to each request's own steering)."""
        parsed = parse_entries(list(entries), prefix="steer")
        check_entries(parsed, self._frontend.shape(), prefix="steer")
        payload = [e.model_dump() for e in parsed]
        self._llm.collective_rpc("dynsteer_set_global", args=(payload,))
        self._frontend.global_fingerprint = (
            hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=12)
            .hexdigest() if payload else None)
        self._frontend.global_phase_specific = any(e.phase != "all" for e in parsed)

    def clear_global(self) -> None:
        """Remove global steering."""
        self._llm.collective_rpc("dynsteer_set_global", args=([],))
        self._frontend.global_fingerprint = None
        self._frontend.global_phase_specific = False

    def info(self) -> list[dict[str, Any]]:
        """Per-worker counters (rows in use, live requests, ...)."""
        return self._llm.collective_rpc("dynsteer_info")
