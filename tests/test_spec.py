"""The request spec contract (no engine): parsing, model checks and error messages."""

from __future__ import annotations

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


def test_valid_spec_passes_model_check():
    spec = parse_spec({"steer": [{"vector": "calm", "layers": [0, 1]},
                                 {"vector": [0, 0, 1, 0], "layers": [2], "hook": "pre_attn"}]})
    check_against_model(spec, SHAPE)


def test_parse_entries_prefix():
    """Global steering entries report their own path."""
    with pytest.raises(SpecError, match=r"steer\[1\].scale"):
        parse_entries([{"vector": "calm", "layers": [0]},
                       {"vector": "calm", "layers": [0], "scale": "big"}])
