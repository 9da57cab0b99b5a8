"""dynsteer's control plane: the request spec, the contract both sides share, and the controller
bases. No vLLM import.

Controllers subclass :class:`Controller` (synchronous: a :class:`StepView` of its requests'
tokens every step, :class:`Actions` back, each an :class:`Action`) or :class:`AsyncController`
(asynchronous: engine events over ZeroMQ, commands back).

Every name is imported on first use, so importing :mod:`.contract` alone (as the plugin does in
every vLLM process) stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_controller import AsyncController
    from .controllers import Action, Actions, Controller, StepView
    from .spec import (
        GateSpec,
        InlineProbe,
        ModelShape,
        SpecError,
        SteerEntry,
        SteeringSpec,
        check_against_model,
        parse_spec,
    )

_EXPORTS = {
    "Action": ".controllers",
    "Actions": ".controllers",
    "Controller": ".controllers",
    "StepView": ".controllers",
    "AsyncController": ".async_controller",
    "GateSpec": ".spec",
    "InlineProbe": ".spec",
    "ModelShape": ".spec",
    "SpecError": ".spec",
    "SteerEntry": ".spec",
    "SteeringSpec": ".spec",
    "check_against_model": ".spec",
    "parse_spec": ".spec",
}
"""Public name -> the submodule that provides it."""

__all__ = [
    "Action",
    "Actions",
    "AsyncController",
    "Controller",
    "GateSpec",
    "InlineProbe",
    "ModelShape",
    "SpecError",
    "SteerEntry",
    "SteeringSpec",
    "StepView",
    "check_against_model",
    "parse_spec",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
