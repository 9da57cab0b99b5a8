"""The wire form's resolution into row contents (``engine_ext/worker/resolve.py``): pure numpy,
no engine. Specs are written as users write them and go through the frontend's
``spec_to_wire``, so these tests pin what a worker builds from what a client sends."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dynsteer.controller.controllers import Action
from dynsteer.controller.spec import SteeringSpec
from dynsteer.controller.wire import probe_to_wire, spec_to_wire
from dynsteer.engine_ext.worker.resolve import (
    UNSTEERED,
    Projection,
    add_contents,
    add_projections,
    entry_contents,
    resolve,
    static_only,
    switched,
)

H = 4
MONITOR = frozenset({("post_block", 1)})
V = [1.0, 2.0, 0.0, -1.0]
W = [0.0, 0.0, 3.0, 4.0]


def _wire(spec: dict[str, Any]) -> dict[str, Any]:
    return spec_to_wire(SteeringSpec.model_validate(spec))


def _resolve(spec: dict[str, Any], vectors: dict[str, np.ndarray] | None = None,
             probes: dict[str, Any] | None = None):
    return resolve(_wire(spec), vectors or {}, probes or {}, H, MONITOR)


def _gate(**extra: Any) -> dict[str, Any]:
    return {"probe": {"weights": W, "threshold": 0.5, "sharpness": 2.0}, "layer": 1,
            "steer": [{"vector": V, "layers": [0], "scale": 3.0}], **extra}


def test_an_add_entry_lands_in_its_phases_at_each_layer_scaled():
    got = _resolve({"steer": [{"vector": V, "layers": [0, 2], "scale": 2.0,
                               "phase": "prefill", "hook": "pre_attn"}]})
    want = np.float32(2.0) * np.asarray(V, np.float32)
    assert set(got.own["prefill"]) == {("pre_attn", 0), ("pre_attn", 2)}
    for vec in got.own["prefill"].values():
        np.testing.assert_array_equal(vec, want)
        assert vec.dtype == np.float32
    assert got.own["decode"] == {} and got.probe is None and not got.trace
    assert not got.dynamic("prefill") and not got.dynamic("decode")


def test_entries_at_one_site_sum_and_scale_zero_adds_nothing():
    got = _resolve({"steer": [{"vector": V, "layers": [1]},
                              {"vector": W, "layers": [1], "phase": "decode"},
                              {"vector": W, "layers": [3], "scale": 0.0}]})
    np.testing.assert_array_equal(got.own["prefill"][("post_block", 1)], np.float32(V))
    np.testing.assert_array_equal(got.own["decode"][("post_block", 1)],
                                  np.float32(V) + np.float32(W))
    assert ("post_block", 3) not in got.own["prefill"]


def test_named_vectors_resolve_in_the_given_registry():
    named = {"calm": np.asarray(W, np.float32)}
    got = _resolve({"steer": [{"vector": "calm", "layers": [1], "scale": -1.0}]}, named)
    np.testing.assert_array_equal(got.own["decode"][("post_block", 1)], -np.float32(W))
    with pytest.raises(KeyError):
        _resolve({"steer": [{"vector": "calm", "layers": [1]}]}, {})


def test_a_vector_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="vector length 3 != hidden 4"):
        _resolve({"steer": [{"vector": [1.0, 2.0, 3.0], "layers": [1]}]})


def test_ablate_and_clamp_become_unit_directions_static_or_gated():
    got = _resolve({"steer": [{"vector": W, "layers": [1], "op": "ablate"}],
                    "gate": _gate(steer=[{"vector": V, "layers": [1], "op": "clamp",
                                          "value": 0.25, "scale": 0.5}])})
    own, gated = got.projections["prefill"][("post_block", 1)]
    np.testing.assert_allclose(own.direction, np.float32(W) / 5.0)
    assert (own.static, own.gated, own.value) == (1.0, 0.0, 0.0)
    assert (gated.static, gated.gated, gated.value) == (0.0, 0.5, 0.25)
    assert np.linalg.norm(gated.direction.astype(np.float64)) == pytest.approx(1.0, rel=1e-6)
    assert got.dynamic("prefill") and got.dynamic("decode")
    assert static_only(got.projections["decode"]) == {("post_block", 1): (own,)}


def test_a_projection_without_a_direction_is_refused():
    with pytest.raises(ValueError, match="needs a vector with a direction"):
        _resolve({"steer": [{"vector": [0.0] * H, "layers": [1], "op": "ablate"}]})


def test_a_gate_places_its_probe_with_the_request_overrides():
    got = _resolve({"gate": _gate(threshold=1.5, trace=True)})
    assert got.probe is not None and got.probe.site == ("post_block", 1)
    np.testing.assert_array_equal(got.probe.weights, np.float32(W))
    assert (got.probe.threshold, got.probe.sharpness) == (1.5, 2.0)
    assert got.trace and got.own["prefill"] == {}
    np.testing.assert_array_equal(got.gated["decode"][("post_block", 0)], 3 * np.float32(V))


def test_a_registered_probe_supplies_threshold_and_sharpness():
    probes = {"harm": probe_to_wire(np.float32(V), 4.0, 0.25)}
    got = _resolve({"gate": _gate(probe="harm")}, probes=probes)
    assert (got.probe.threshold, got.probe.sharpness) == (4.0, 0.25)
    np.testing.assert_array_equal(got.probe.weights, np.float32(V))


def test_a_gate_away_from_the_monitor_sites_is_refused():
    with pytest.raises(ValueError, match="post_block@2 is not a monitor site"):
        _resolve({"gate": _gate(layer=2)})


def test_a_gated_entry_steers_the_prefill_only_in_its_phase():
    got = _resolve({"gate": _gate(steer=[{"vector": V, "layers": [0], "phase": "decode"}])})
    assert not got.dynamic("prefill") and got.dynamic("decode")


def test_switching_rewrites_the_gated_tier_and_extends_the_key():
    wire = _wire({"steer": [{"vector": V, "layers": [0]}], "gate": _gate()})
    out = switched(wire, wire["key"], Action.SWITCH_VECTOR, "calm", {"calm"}, set())
    assert [e[4] for e in out["gate"]["steer"]] == ["calm"]
    assert out["steer"] == wire["steer"] and out["key"] == wire["key"] + "|SWITCH_VECTOR:calm"
    assert isinstance(wire["gate"]["steer"][0][4], bytes), "the request's spec is not changed"
    probe = switched(wire, wire["key"], Action.SWITCH_PROBE, "harm", set(), {"harm"})
    assert (probe["gate"]["probe"], probe["gate"]["threshold"]) == ("harm", None)
    stop = switched(wire, wire["key"], Action.STOP, None, set(), set())
    assert stop["steer"] == [] and stop["gate"]["steer"] == []
    with pytest.raises(KeyError, match="no registered vector"):
        switched(wire, wire["key"], Action.SWITCH_VECTOR, "gone", set(), set())
    with pytest.raises(KeyError, match="no registered probe"):
        switched(wire, wire["key"], Action.SWITCH_PROBE, "gone", set(), set())


def test_contents_and_projections_combine_without_aliasing():
    a = {("post_block", 0): np.ones(H, np.float32)}
    total = add_contents(a, a)
    np.testing.assert_array_equal(total[("post_block", 0)], 2 * np.ones(H, np.float32))
    assert total[("post_block", 0)] is not a[("post_block", 0)]
    p = Projection(np.float32([1, 0, 0, 0]), 1.0, 0.0, 0.0)
    q = Projection(np.float32([0, 1, 0, 0]), 0.0, 1.0, 0.0)
    assert add_projections({("x", 0): (p,)}, {("x", 0): (q,)}) == {("x", 0): (p, q)}


def test_global_entries_resolve_like_own_entries():
    wire = _wire({"steer": [{"vector": V, "layers": [2], "phase": "decode"}]})
    adds, projections = entry_contents(wire["steer"], {}, H)
    assert set(adds["decode"]) == {("post_block", 2)} and adds["prefill"] == {}
    assert projections == UNSTEERED.projections
