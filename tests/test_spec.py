"""The request spec contract (no engine): parsing, model checks and error messages."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dynsteer.controller.spec import (
    ModelShape,
    SpecError,
    check_against_model,
    parse_entries,
    parse_spec,
)

SHAPE = ModelShape(hidden_size=4, num_layers=3,
                   sites=frozenset({("post_block", 0), ("post_block", 1), ("pre_attn", 2)}),
                   vector_norms={"calm": 1.0})


def test_defaults():
    """hook, scale and phase default to post_block, 1.0 and all."""
    spec = parse_spec({"steer": [{"vector": [1, 2, 3, 4], "layers": [0]}]})
    (entry,) = spec.steer
    assert (entry.hook, entry.scale, entry.phase) == ("post_block", 1.0, "all")


def test_json_string_equals_dict():
    """A JSON string parses to the same spec as the dict."""
    raw = {"steer": [{"vector": "calm", "layers": [1], "phase": "decode"}]}
    assert parse_spec(json.dumps(raw)) == parse_spec(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"steer": [}', "dynsteer: malformed JSON"),
        (3, "dynsteer: expected an object"),
        ({"steer": [{"vector": [1, 2], "layers": []}]}, r"dynsteer.steer\[0\].layers"),
        ({"steer": [{"vector": [1.0, float("nan")], "layers": [0]}]},
         r"dynsteer.steer\[0\].vector\[1\]"),
        ({"steer": [{"vector": [1], "layers": [0], "phase": "later"}]},
         r"dynsteer.steer\[0\].phase"),
        ({"steer": [], "extra": 1}, "dynsteer.extra"),
        ({"version": 2}, "dynsteer.version"),
    ],
)
def test_shape_errors_name_the_field(raw, message):
    """Malformed specs raise SpecError naming the field."""
    with pytest.raises(SpecError, match=message):
        parse_spec(raw)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"vector": [1, 2, 3], "layers": [0]}, "expected 4 floats"),
        ({"vector": "angry", "layers": [0]}, "unknown vector name 'angry'"),
        ({"vector": [1, 2, 3, 4], "layers": [3]}, "layer 3 does not exist"),
        ({"vector": [1, 2, 3, 4], "layers": [2]}, "'post_block@2' to the engine option"),
    ],
)
def test_model_errors_name_the_field(entry, message):
    """Specs that do not fit the served model are rejected with the fix in the message."""
    with pytest.raises(SpecError, match=message):
        check_against_model(parse_spec({"steer": [entry]}), SHAPE)


def test_a_hook_the_layers_lack_is_refused_naming_the_layer():
    """A site the model's layers cannot have (``post_attn`` of a parallel attention + MLP
    layer) is refused with the layer, its layout and the hooks it has, not with advice to
    configure it; a site the layers have but the engine lacks keeps that advice."""
    why = "(NeoXLayer: parallel attention + MLP) has no post_attn"
    shape = dataclasses.replace(SHAPE, missing_hook=lambda h: why if h == "post_attn" else None)
    with pytest.raises(SpecError, match=r"steer\[0\]\.layers: post_attn@1 does not exist: layer 1 "
                                         r"\(NeoXLayer: parallel attention \+ MLP\) has no "
                                         r"post_attn; steer pre_attn or post_block of that layer"):
        check_against_model(parse_spec({"steer": [{"vector": "calm", "layers": [1],
                                                   "hook": "post_attn"}]}), shape)
    with pytest.raises(SpecError, match="'pre_attn@1' to the engine option"):
        check_against_model(parse_spec({"steer": [{"vector": "calm", "layers": [1],
                                                   "hook": "pre_attn"}]}), shape)


def test_valid_spec_passes_model_check():
    spec = parse_spec({"steer": [{"vector": "calm", "layers": [0, 1]},
                                 {"vector": [0, 0, 1, 0], "layers": [2], "hook": "pre_attn"}]})
    check_against_model(spec, SHAPE)


def test_parse_entries_prefix():
    """Global steering entries report their own path."""
    with pytest.raises(SpecError, match=r"steer\[1\].scale"):
        parse_entries([{"vector": "calm", "layers": [0]},
                       {"vector": "calm", "layers": [0], "scale": "big"}])


PROJECTING = ModelShape(hidden_size=4, num_layers=3, sites=SHAPE.sites,
                        vector_norms={"calm": 1.0, "zero": 0.0}, max_projections=2)


def test_ablate_and_clamp_are_accepted():
    spec = parse_spec({"steer": [
        {"vector": "calm", "layers": [0], "op": "ablate"},
        {"vector": [0, 0, 1e-30, 0], "layers": [0], "op": "clamp", "value": -2.5},
        {"vector": [1e30, 0, 0, 0], "layers": [1], "op": "ablate", "phase": "prefill"}]})
    assert [e.op for e in spec.steer] == ["ablate", "clamp", "ablate"]
    check_against_model(spec, PROJECTING)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"vector": "calm", "layers": [0], "op": "clamp"},
         r"^dynsteer.steer\[0\]: op 'clamp' needs a value"),
        ({"vector": "calm", "layers": [0], "value": 1.0},
         r"^dynsteer.steer\[0\]: value is only for op 'clamp'"),
        ({"vector": "calm", "layers": [0], "op": "rotate"}, r"^dynsteer.steer\[0\].op: "),
        ({"vector": "calm", "layers": [0], "op": "clamp", "value": float("nan")},
         r"^dynsteer.steer\[0\].value: "),
    ],
)
def test_malformed_projections_name_the_field(entry, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"steer": [entry]})


@pytest.mark.parametrize(
    ("entries", "shape", "message"),
    [
        ([{"vector": "calm", "layers": [0], "op": "ablate"}], SHAPE,
         r"^dynsteer.steer\[0\].op: 'ablate' needs the engine option "
         r"dynsteer.max_projections >= 1 \(it is 0"),
        ([{"vector": "zero", "layers": [0], "op": "ablate"}], PROJECTING,
         r"^dynsteer.steer\[0\].vector: op 'ablate' acts along the vector's direction, and a "
         "zero vector has none"),
        ([{"vector": [0, 0, 0, 0], "layers": [0], "op": "clamp", "value": 1.0}], PROJECTING,
         r"^dynsteer.steer\[0\].vector: op 'clamp' acts along"),
        ([{"vector": "calm", "layers": [0], "op": "clamp", "value": 1e9}], PROJECTING,
         r"^dynsteer.steer\[0\].value: ‖scale · vector‖ = 1e\+09 exceeds"),
        ([{"vector": "calm", "layers": [0, 1], "op": "ablate", "phase": "decode"}] * 3,
         PROJECTING, r"^dynsteer: more than 2 ablate / clamp / norm_match entries steer "
         r"decode tokens at \(post_block, layer 0\); raise dynsteer.max_projections"),
    ],
)
def test_projections_that_do_not_fit_the_engine_are_refused(entries, shape, message):
    with pytest.raises(SpecError, match=message):
        check_against_model(parse_spec({"steer": entries}), shape)


def test_projection_slots_count_the_gate_s_entries_too():
    gate = {"probe": {"weights": [1.0, 0, 0, 0]}, "layer": 0,
            "steer": [{"vector": "calm", "layers": [1], "op": "ablate"}] * 2}
    spec = parse_spec({"steer": [{"vector": "calm", "layers": [1], "op": "ablate",
                                  "phase": "prefill"}], "gate": gate})
    with pytest.raises(SpecError, match="steer prefill tokens at"):
        check_against_model(spec, PROJECTING)
    check_against_model(parse_spec({"gate": gate}), PROJECTING)


@pytest.mark.parametrize(("probe", "message"), [
    ({"weights": [1.0] * 4, "threshold": 1e39}, "dynsteer.gate.probe.threshold: 1e+39 is not "
                                                "finite"),
    ({"weights": [1.0] * 4, "threshold": 0.0, "sharpness": 0}, "dynsteer.gate.probe.sharpness: "
                                                               "Input should be greater than 0"),
])
def test_an_inline_probe_error_names_its_field_not_the_name_branch(probe, message):
    """``probe`` is a name or an object: an object's error is about the object."""
    gate = {"probe": probe, "layer": 0, "steer": [{"vector": [1.0] * 4, "layers": [1]}]}
    with pytest.raises(SpecError) as info:
        parse_spec({"gate": gate})
    assert str(info.value).startswith(message)


def test_unknown_name_errors_list_a_few_names():
    names = {f"v{i:03d}": 1.0 for i in range(256)}
    shape = ModelShape(hidden_size=4, num_layers=3, sites=SHAPE.sites, vector_norms=names)
    with pytest.raises(SpecError) as info:
        check_against_model(parse_spec({"steer": [{"vector": "nope", "layers": [0]}]}), shape)
    message = str(info.value)
    assert "v000, v001" in message and "v255" not in message
    assert "and 248 more: GET /v1/dynsteer/vectors" in message and len(message) < 400
