"""Size and depth bounds of the steering spec (no vLLM import)."""

from __future__ import annotations

import json

import pytest

from dynsteer.controller.spec import (
    MAX_ENTRIES,
    MAX_JSON_DEPTH,
    MAX_LAYERS,
    SpecError,
    check_json_depth,
    json_depth,
    parse_entries,
    parse_spec,
)

ENTRY = {"vector": "calm", "layers": [1]}


def deep(depth: int) -> str:
    return '{"steer": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("raw", [deep(2000), deep(2000).encode(), deep(MAX_JSON_DEPTH)])
def test_deep_json_string_is_a_spec_error_naming_the_field(raw):
    with pytest.raises(SpecError, match=rf"^dynsteer: JSON nested deeper than {MAX_JSON_DEPTH} "):
        parse_spec(raw)
    with pytest.raises(SpecError, match=r"^steer: JSON nested deeper"):
        parse_entries(raw)


def test_depth_at_the_limit_reaches_validation():
    with pytest.raises(SpecError, match=r"^dynsteer\.steer\[0\]"):
        parse_spec(deep(MAX_JSON_DEPTH - 1))


def test_too_many_entries():
    with pytest.raises(SpecError, match=r"^dynsteer\.steer: .*64"):
        parse_spec({"steer": [ENTRY] * (MAX_ENTRIES + 1)})
    with pytest.raises(SpecError, match=r"^dynsteer\.steer"):
        parse_spec(json.dumps({"steer": [ENTRY] * (MAX_ENTRIES + 1)}))
    gate = {"probe": "p", "layer": 0, "steer": [ENTRY] * (MAX_ENTRIES + 1)}
    with pytest.raises(SpecError, match=r"^dynsteer\.gate\.steer"):
        parse_spec({"gate": gate})
    with pytest.raises(SpecError, match=rf"^steer: at most {MAX_ENTRIES} steer entries, got 65"):
        parse_entries([ENTRY] * (MAX_ENTRIES + 1))
    assert len(parse_spec({"steer": [ENTRY] * MAX_ENTRIES}).steer) == MAX_ENTRIES
    assert len(parse_entries([ENTRY] * MAX_ENTRIES)) == MAX_ENTRIES


def test_too_many_layers():
    with pytest.raises(SpecError, match=r"^dynsteer\.steer\[0\]\.layers"):
        parse_spec({"steer": [{"vector": "v", "layers": [1] * (MAX_LAYERS + 1)}]})
    parse_spec({"steer": [{"vector": "v", "layers": [1] * MAX_LAYERS}]})


@pytest.mark.parametrize("text,depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, {"b": 2}]}', 3), ('"[[[["', 0),
    ('["a\\"[[[", [1]]', 2), ('["a\\\\", [[1]]]', 3), ("[[], [[]]]", 3), ("[" * 3000, 3000),
    ('{"k\\u005b": "]"}', 1),
])
def test_json_depth(text, depth):
    assert json_depth(text) == depth
    assert json_depth(text.encode()) == depth


@pytest.mark.parametrize("text", [
    "[" * 8 + "]" * 8, "[" * 9 + "]" * 9, '["[[[[[[[[[[", ' + "[" * 7 + "]" * 7 + "]",
    '{"a": [' + ", ".join(["[]"] * 40) + "]}",
])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_check_json_depth(text, as_bytes):
    """The opener count lets shallow text through at once; text with more openers than the
    limit gets the scan, which still tells depth from count (strings, siblings)."""
    data = text.encode() if as_bytes else text
    if json_depth(text) > 8:
        with pytest.raises(SpecError, match=r"^dynsteer: JSON nested deeper than 8 levels"):
            check_json_depth(data, "dynsteer", limit=8)
    else:
        check_json_depth(data, "dynsteer", limit=8)


def test_json_depth_stops_past_the_limit():
    assert json_depth("[" * 10_000_000, limit=64) > 64
