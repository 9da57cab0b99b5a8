"""dynsteer: dynamic, activation-conditioned steering for vLLM.

The names users import::

    from dynsteer import Steering, SteeringSpec, Probe, from_sklearn, DynsteerClient

* :class:`Steering`: global steering and named vectors on an offline ``LLM`` started with
  ``additional_config={"dynsteer": {}}``.
* :class:`SteeringSpec` and its parts (:class:`SteerEntry`, :class:`GateSpec`,
  :class:`InlineProbe`), :func:`parse_spec` and :class:`SpecError`: the per-request spec.
* :class:`Probe`, :class:`ProbeSite`, :class:`ModelFingerprint`, :func:`from_sklearn`,
  :func:`calibrate_threshold` and :func:`upload`: linear probes for gates.
* :class:`DynsteerClient`: the ``/v1/dynsteer/`` routes of a running server.
* :func:`activations_of` and :func:`activations_of_stream`: the captured activations of an
  OpenAI-compatible completion (a response, or a stream's chunks).
* :func:`default_model_path`: the folder of the embedded default model (SmolLM2-135M-Instruct),
  made on first use without a model hub (``dynsteer model path`` prints it).

Controllers subclass the bases in :mod:`dynsteer.controller`. Everything else is private.

Every name is imported on first use: vLLM imports ``dynsteer.engine_ext.plugin`` in every
process, which imports this package first, so importing it loads none of vLLM, torch, pydantic
or the submodules. (Its folder is ``api/`` in the checkout, not ``dynsteer/``: a ``dynsteer/``
folder in the repository root would shadow the installed package for ``python -m`` run there.)
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynsteer.controller.activations import activations_of, activations_of_stream
    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.contract import SpecError
    from dynsteer.controller.spec import GateSpec, InlineProbe, SteerEntry, SteeringSpec, parse_spec
    from dynsteer.engine_ext.default_model import default_model_path
    from dynsteer.engine_ext.frontend.offline_api import Steering
    from dynsteer.probes import (
        ModelFingerprint,
        Probe,
        ProbeSite,
        calibrate_threshold,
        from_sklearn,
        upload,
    )

_EXPORTS = {
    "Steering": "dynsteer.engine_ext.frontend.offline_api",
    "SteeringSpec": "dynsteer.controller.spec",
    "SteerEntry": "dynsteer.controller.spec",
    "GateSpec": "dynsteer.controller.spec",
    "InlineProbe": "dynsteer.controller.spec",
    "parse_spec": "dynsteer.controller.spec",
    "SpecError": "dynsteer.controller.contract",
    "Probe": "dynsteer.probes",
    "ProbeSite": "dynsteer.probes",
    "ModelFingerprint": "dynsteer.probes",
    "from_sklearn": "dynsteer.probes",
    "calibrate_threshold": "dynsteer.probes",
    "upload": "dynsteer.probes",
    "DynsteerClient": "dynsteer.controller.client",
    "activations_of": "dynsteer.controller.activations",
    "activations_of_stream": "dynsteer.controller.activations",
    "default_model_path": "dynsteer.engine_ext.default_model",
}
"""Public name -> the module that defines it."""

__all__ = [
    "DynsteerClient",
    "GateSpec",
    "InlineProbe",
    "ModelFingerprint",
    "Probe",
    "ProbeSite",
    "SpecError",
    "SteerEntry",
    "Steering",
    "SteeringSpec",
    "activations_of",
    "activations_of_stream",
    "calibrate_threshold",
    "default_model_path",
    "from_sklearn",
    "parse_spec",
    "upload",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
