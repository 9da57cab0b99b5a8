"""The public API: what ``dynsteer`` and ``dynsteer.controller`` export, and that importing it
costs nothing until a name is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import dynsteer
import dynsteer.controller

CONTROLLER_BASES = ("Controller", "AsyncController", "Action", "Actions", "StepView")


@pytest.mark.parametrize("name", dynsteer.__all__)
def test_every_top_level_name_resolves(name):
    value = getattr(dynsteer, name)
    assert value.__module__.startswith("dynsteer."), (name, value.__module__)
    assert name in dir(dynsteer)


@pytest.mark.parametrize("name", dynsteer.controller.__all__)
def test_every_controller_name_resolves(name):
    value = getattr(dynsteer.controller, name)
    assert value.__module__.startswith("dynsteer.controller."), (name, value.__module__)
    assert name in dir(dynsteer.controller)


def test_the_documented_names_are_exported():
    assert {"Steering", "Probe", "from_sklearn", "calibrate_threshold", "DynsteerClient",
            "SteeringSpec", "SteerEntry", "GateSpec", "InlineProbe", "SpecError", "parse_spec",
            "default_model_path", "activations_of", "activations_of_stream",
            } <= set(dynsteer.__all__)
    assert set(CONTROLLER_BASES) <= set(dynsteer.controller.__all__)


def test_from_imports():
    from dynsteer import DynsteerClient, Probe, Steering
    from dynsteer.controller import Action, Actions, AsyncController, Controller, StepView
    from dynsteer.controller.async_controller import AsyncController as defined_async
    from dynsteer.controller.client import DynsteerClient as defined_client
    from dynsteer.controller.controllers import Controller as defined_controller
    from dynsteer.engine_ext.frontend.offline_api import Steering as defined_steering
    from dynsteer.probes.probe import Probe as defined_probe

    assert Steering is defined_steering and Probe is defined_probe
    assert DynsteerClient is defined_client
    assert AsyncController is defined_async and Controller is defined_controller
    assert len(Actions.of([1, 2], Action.LATCH).check()) == 2
    assert StepView.__dataclass_fields__.keys() >= {"request", "score", "gate"}


def test_one_object_per_name_across_packages():
    """The top level re-exports the subpackages' objects, not copies."""
    import dynsteer.engine_ext

    for name in ("SpecError", "SteerEntry", "SteeringSpec"):
        assert getattr(dynsteer, name) is getattr(dynsteer.controller, name)
        assert getattr(dynsteer, name) is getattr(dynsteer.engine_ext, name)
    assert dynsteer.Steering is dynsteer.engine_ext.Steering


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dynsteer.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dynsteer.controller.nope  # noqa: B018
    with pytest.raises(ImportError):
        from dynsteer import nope  # noqa: F401


def test_client_side_names_need_neither_vllm_nor_torch():
    """Importing the package, listing it and using the client-side names (spec, probes, HTTP
    client, controller bases, the default model's folder) never loads vLLM or torch; only
    ``Steering`` does."""
    code = (
        "import json, sys; import dynsteer; dir(dynsteer); "
        "from dynsteer import DynsteerClient, Probe, SteeringSpec, from_sklearn, parse_spec; "
        "from dynsteer import activations_of, activations_of_stream, calibrate_threshold; "
        "from dynsteer import default_model_path; "
        "from dynsteer.controller import AsyncController, Controller; "
        "print(json.dumps([m for m in ('vllm', 'torch') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
