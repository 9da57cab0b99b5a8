"""dynsteer's vLLM side: the plugin, the in-graph ops and the Python API.

Enable it on an engine with ``LLM(..., additional_config={"dynsteer": {}})`` and steer requests
with ``SamplingParams(extra_args={"dynsteer": {"steer": [...]}})``.

The public names are imported on first use: vLLM imports this package in every process to load
the plugin, and a process where no engine enables it should not pay for the API's modules.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpecError", "SteerEntry", "Steering", "SteeringSpec"]


def __getattr__(name: str) -> Any:
    if name == "Steering":
        from .frontend.offline_api import Steering

        return Steering
    if name in ("SpecError", "SteerEntry", "SteeringSpec"):
        from dynsteer.controller import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
