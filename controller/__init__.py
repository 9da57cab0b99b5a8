"""dynsteer's control plane: the request spec, the contract both sides share, (later)
controllers. No vLLM import.

The spec's names are imported on first use, so importing :mod:`.contract` alone (as the plugin
does in every vLLM process) stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GateSpec",
    "InlineProbe",
    "ModelShape",
    "SpecError",
    "SteerEntry",
    "SteeringSpec",
    "check_against_model",
    "parse_spec",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
