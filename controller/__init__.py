"""dynsteer's control plane: the request spec (and, later, controllers). No vLLM import."""

from dynsteer.controller.spec import (
    GateSpec,
    InlineProbe,
    ModelShape,
    SpecError,
    SteerEntry,
    SteeringSpec,
    check_against_model,
    parse_spec,
)

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
