"""Admission's parse cache (no engine): a spec is parsed once per content, whatever its form,
and never served stale."""

from __future__ import annotations

import json

import numpy as np

from dynsteer.engine_ext.compat.frontend import _without
from dynsteer.engine_ext.frontend import admission
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.options import EngineOptions

HIDDEN = 8


def frontend() -> FrontendState:
    return FrontendState(options=EngineOptions(max_rows=4), hidden_size=HIDDEN, num_layers=2,
                         sites=(("post_block", 0), ("post_block", 1)), dtype_max=65504.0)


def spec(values) -> dict:
    return {"steer": [{"vector": list(values), "layers": [1]}]}


def test_dict_specs_are_parsed_once_per_content():
    state = frontend()
    first = admission.admit(state, {"dynsteer": spec([0.5] * HIDDEN)})
    again = admission.admit(state, {"dynsteer": spec([0.5] * HIDDEN)})  # another object
    assert len(state.parsed) == 1 and again[1] is first[1]
    as_text = admission.admit(state, {"dynsteer": json.dumps(spec([0.5] * HIDDEN))})
    assert as_text[1]["key"] == first[1]["key"]


def test_a_changed_dict_is_parsed_again_never_served_stale():
    state = frontend()
    raw = spec([0.5] * HIDDEN)
    before = admission.admit(state, {"dynsteer": raw})[1]
    raw["steer"][0]["vector"][3] = 2.0  # the caller mutates its dict in place
    after = admission.admit(state, {"dynsteer": raw})[1]
    assert after["key"] != before["key"]
    assert np.frombuffer(after["steer"][0][4], "<f4")[3] == 2.0


def test_ints_floats_and_booleans_are_different_contents():
    state = frontend()
    admission.admit(state, {"dynsteer": spec([1.0] * HIDDEN)})
    admission.admit(state, {"dynsteer": spec([1] * HIDDEN)})
    assert len(state.parsed) == 2
    bad = spec([True] * HIDDEN)
    for _ in range(2):  # a refused spec is not cached
        try:
            admission.admit(state, {"dynsteer": bad})
        except ValueError as e:
            assert "vector" in str(e)
        else:
            raise AssertionError("booleans are not numbers")
    assert len(state.parsed) == 2


def test_a_dict_that_is_not_plain_data_is_checked_as_usual():
    """A value msgpack cannot encode leaves the dict uncached; validation still names it."""
    state = frontend()
    try:
        admission.admit(state, {"dynsteer": {**spec([0.5] * HIDDEN), "extra": object()}})
    except ValueError as e:
        assert str(e).startswith("dynsteer.extra:")
    else:
        raise AssertionError("an unknown field is refused")
    assert len(state.parsed) == 0


def test_vllm_gets_params_without_the_parsed_spec_and_the_callers_stay_whole():
    """vLLM deep-copies a request's params: after admission it gets a copy without the spec
    (a float list would cost it more than the admission), the caller's params are untouched."""
    from vllm import SamplingParams

    raw = spec([0.5] * HIDDEN)
    params = SamplingParams(max_tokens=2, extra_args={"dynsteer": raw, "other": 1})
    handed = _without(params, "dynsteer")
    assert handed is not params and handed.extra_args == {"other": 1}
    assert params.extra_args == {"dynsteer": raw, "other": 1}
    assert handed.max_tokens == 2
    plain = SamplingParams(max_tokens=2)
    assert _without(plain, "dynsteer") is plain
