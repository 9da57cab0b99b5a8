"""The control plane's checks without an engine: names, explicit replace, registry caps and the
one numeric path shared with per-request specs."""

from __future__ import annotations

import numpy as np
import pytest

from dynsteer.controller.spec import SpecError, check_against_model, parse_spec
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.frontend.control_plane import ConflictError, ControlError, ControlPlane
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.probes import ModelFingerprint, Probe, ProbeSite

HIDDEN = 8


def plane(**options) -> ControlPlane:
    return ControlPlane(FrontendState(
        options=EngineOptions(**options), hidden_size=HIDDEN, num_layers=2,
        sites=(("post_block", 0), ("post_block", 1)), dtype_max=65504.0))


def register(p: ControlPlane, kind: str, name: str, replace: bool = False) -> None:
    """Validate and commit (the workers' RPC is not needed here)."""
    if kind == "vector":
        p.register_vector(name, np.ones(HIDDEN), replace=replace).commit()
    else:
        p.register_probe(name, np.ones(HIDDEN), 0.0, 1.0, replace=replace).commit()


@pytest.mark.parametrize("kind", ["vector", "probe"])
@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "", "x" * 65, "sp ace"])
def test_names_that_would_be_paths_or_hidden_files_are_refused(kind, name):
    with pytest.raises(ControlError, match="is not a valid name"):
        register(plane(), kind, name)


@pytest.mark.parametrize("kind", ["vector", "probe"])
def test_taken_names_need_an_explicit_replace(kind):
    p = plane()
    register(p, kind, "calm")
    generation = p.frontend.registry_generation
    with pytest.raises(ConflictError, match="already registered; replace it explicitly"):
        register(p, kind, "calm")
    assert p.frontend.registry_generation == generation
    register(p, kind, "calm", replace=True)
    assert p.frontend.registry_generation == generation + 1


@pytest.mark.parametrize("kind,option", [("vector", "max_vectors"), ("probe", "max_probes")])
def test_full_registries_refuse_new_names_but_allow_replacing(kind, option):
    p = plane(**{option: 2})
    register(p, kind, "a")
    register(p, kind, "b")
    with pytest.raises(ConflictError, match=f"the limit \\(engine option dynsteer.{option}\\)"):
        register(p, kind, "c")
    register(p, kind, "a", replace=True)
    (p.unregister_vector if kind == "vector" else p.unregister_probe)("a").commit()
    register(p, kind, "c")


@pytest.mark.parametrize("values,fragment", [
    ([1e39] * HIDDEN, "vector[0]: 1e+39 is not finite in float32"),
    (["1.0"] * HIDDEN, "vector[0]: Input should be a valid number"),
    ([True] * HIDDEN, "vector[0]: Input should be a valid number"),
    (np.array([True] * HIDDEN), "vector: expected numbers, got an array of bool"),
    ([1.0] * (HIDDEN - 1), "vector: expected 8 floats"),
    ([2e4] * HIDDEN, "exceeds the engine's max_steer_norm"),
])
def test_vectors_are_checked_like_inline_vectors(values, fragment):
    with pytest.raises(ValueError) as e:
        plane().register_vector("v", values)
    assert fragment in str(e.value)


def test_named_vector_scale_is_checked_against_its_norm():
    """A registered vector's ``scale`` is bounded like an inline vector's: ‖scale·v‖."""
    p = plane(max_steer_norm=100.0)
    register(p, "vector", "ones")  # norm sqrt(8)
    ok = parse_spec({"steer": [{"vector": "ones", "layers": [0], "scale": 35.0}]})
    check_against_model(ok, p.frontend.shape())
    too_big = parse_spec({"steer": [{"vector": "ones", "layers": [0], "scale": 36.0}]})
    with pytest.raises(SpecError, match=r"dynsteer\.steer\[0\]: ‖scale · vector‖ = 101.8"):
        check_against_model(too_big, p.frontend.shape())


def test_the_model_dtype_bounds_the_steering():
    """In an fp16 model a vector whose elements fit float32 but not float16 is refused."""
    p = plane(max_steer_norm=1e12)
    with pytest.raises(ValueError, match="overflows the model's dtype"):
        p.register_vector("v", [1e5] * HIDDEN)


@pytest.mark.parametrize("threshold,sharpness,fragment", [
    (1e39, 1.0, "threshold"), (0.0, 0.0, "sharpness"), (0.0, 1e7, "sharpness"),
    (True, 1.0, "threshold: expected a number"), ("0", 1.0, "threshold: expected a number"),
])
def test_probe_numbers(threshold, sharpness, fragment):
    with pytest.raises(ControlError if isinstance(threshold, (bool, str)) else ValueError,
                       match=fragment):
        plane().register_probe("p", np.ones(HIDDEN), threshold, sharpness)


def test_changes_send_the_workers_the_checked_float32_bytes():
    """Workers get the resolved form (msgpack-able bytes and numbers) and apply it unchecked."""
    p = plane()
    values = np.linspace(-1, 1, HIDDEN)
    assert p.register_vector("v", values).args == ("v", values.astype("<f4").tobytes())
    change = p.register_probe("p", values, 0.5, 2)
    assert change.args == ("p", [values.astype("<f4").tobytes(), 0.5, 2.0])


def test_probe_objects_are_checked_against_the_served_model():
    """One compatibility check (``Probe.incompatibilities``), worded with the field at fault."""
    trained = ModelFingerprint(architecture="Qwen3ForCausalLM", hidden_size=HIDDEN, num_layers=2)
    probe = Probe(name="p", weights=np.ones(HIDDEN), site=ProbeSite(layer=1), fingerprint=trained)
    with pytest.raises(ControlError, match=r"^fingerprint: architecture: probe was trained on "
                                           r"'Qwen3ForCausalLM', model has 'unknown'$"):
        plane().register_probe_object(probe)
    bare = probe.replace(fingerprint=None)
    with pytest.raises(ControlError, match=r"^site.layer: 5 does not exist \(the model has 2"):
        plane().register_probe_object(bare.replace(site=ProbeSite(layer=5)))
    with pytest.raises(ControlError, match=r"^site: pre_attn@1 is not a monitor site"):
        plane().register_probe_object(bare.replace(site=ProbeSite(layer=1, hook="pre_attn")))
    p = plane()
    p.register_probe_object(bare).commit()
    assert p.frontend.probes == {"p": bare}
