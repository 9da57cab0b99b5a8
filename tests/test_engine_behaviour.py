"""Engine-level behaviour of static steering on the Llama tiny model (CPU build, compile on).

The plain engine runs first on the same model path: the plugin engine that follows must not be
served the plain engine's compiled graph (vLLM's compile cache), or steering would be lost.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from engine_utils import (
    assert_same_output,
    logprobs_of,
    params,
    raw_set_global,
    run,
    start_llm,
    stop_llm,
)
from hf_reference import assert_logprobs_match_hf
from tiny_models import vec

from dynsteer.controller.spec import parse_entries
from dynsteer.controller.wire import entry_to_wire
from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

PROMPTS = [[1, 5, 9, 200, 31, 4], [1, 77, 78, 79], [1, 400, 12, 12, 12, 90, 91], [1, 2, 3]]
SITES = "post_block@*,pre_attn@0-1"
STEER_A = [{"vector": vec(11), "layers": [1, 2]}]
STEER_B = [{"vector": vec(12), "layers": [0], "hook": "pre_attn", "phase": "decode"}]


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def plain_outputs(model_path):
    """Outputs of stock vLLM (plugin not enabled), computed before the plugin engine starts."""
    llm = start_llm(model_path)
    try:
        return run(llm, PROMPTS, [params() for _ in PROMPTS])
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def llm(model_path, plain_outputs):
    llm = start_llm(model_path, dynsteer={"sites": SITES})
    yield llm
    stop_llm(llm)


def test_plugin_after_plain_engine_on_same_path_steers(llm, hf_llama):
    """The compile cache never hands the plugin engine a graph compiled without its sites."""
    (out,) = run(llm, PROMPTS[:1], [params(spec={"steer": STEER_A})])
    assert_logprobs_match_hf(hf_llama, out, STEER_A)


def test_unsteered_requests_in_mixed_batch_equal_stock_vllm(llm, plain_outputs):
    """Unsteered requests batched with steered ones are token-identical to stock vLLM."""
    specs = [None, {"steer": STEER_A}, None, {"steer": STEER_B}]
    outs = run(llm, PROMPTS, [params(spec=s) for s in specs])
    for i in (0, 2):
        assert_same_output(outs[i], plain_outputs[i])
    assert list(outs[1].outputs[0].token_ids) != list(plain_outputs[1].outputs[0].token_ids) or (
        np.abs(logprobs_of(outs[1])[1] - logprobs_of(plain_outputs[1])[1]).max() > 1e-2
    )


GATE = {"probe": {"weights": vec(40, norm=1.0), "threshold": 0.0, "sharpness": 2.0},
        "layer": 1, "steer": [{"vector": vec(41), "layers": [1, 2]}]}


def test_plain_requests_batched_with_gated_and_static_equal_stock_vllm(llm, plain_outputs,
                                                                       hf_llama):
    """A batch mixing gated, statically steered and plain requests: plain ones are untouched."""
    specs = [None, {"gate": GATE}, {"steer": STEER_A}, None]
    outs = run(llm, PROMPTS, [params(spec=s) for s in specs])
    for i in (0, 3):
        assert_same_output(outs[i], plain_outputs[i])
    assert_logprobs_match_hf(hf_llama, outs[1], gate=GATE)
    assert_logprobs_match_hf(hf_llama, outs[2], STEER_A)


def test_scale_zero_equals_baseline(llm, plain_outputs):
    """``scale: 0`` is exactly no steering."""
    spec = {"steer": [{**STEER_A[0], "scale": 0.0}]}
    (out,) = run(llm, PROMPTS[:1], [params(spec=spec)])
    assert_same_output(out, plain_outputs[0])


def test_spec_as_json_string(llm, hf_llama):
    """The spec may be given as its JSON string (as ``vllm_xargs`` carries it)."""
    (out,) = run(llm, PROMPTS[1:2], [params(spec=json.dumps({"steer": STEER_B}))])
    assert_logprobs_match_hf(hf_llama, out, STEER_B)


def test_global_and_request_steering_add(llm, hf_llama, plain_outputs):
    """Global steering applies to every request and adds to each request's own entries."""
    steering = Steering(llm)
    global_entries = [{"vector": vec(13), "layers": [3], "scale": 0.75}]
    steering.set_global(global_entries)
    try:
        outs = run(llm, PROMPTS[:2], [params(), params(spec={"steer": STEER_A})])
        assert_logprobs_match_hf(hf_llama, outs[0], global_entries)
        assert_logprobs_match_hf(hf_llama, outs[1], global_entries + STEER_A)
    finally:
        steering.clear_global()
    (out,) = run(llm, PROMPTS[:1], [params()])
    assert_same_output(out, plain_outputs[0])


def test_named_vectors(llm, hf_llama):
    """A registered vector is usable by name; after unregistering, the name is rejected."""
    steering = Steering(llm)
    values = vec(14)
    steering.register_vector("happy", values)
    entries = [{"vector": "happy", "layers": [0, 3], "scale": 1.25}]
    (out,) = run(llm, PROMPTS[2:3], [params(spec={"steer": entries})])
    assert_logprobs_match_hf(hf_llama, out, entries, vectors={"happy": values})
    assert "happy" in steering.vectors()
    steering.unregister_vector("happy")
    with pytest.raises(ValueError, match="unknown vector name 'happy'"):
        run(llm, PROMPTS[:1], [params(spec={"steer": entries})])


def _bad(**changes):
    entry = {"vector": vec(1), "layers": [1]}
    entry.update(changes)
    return {"steer": [entry]}


BAD_SPECS = {
    "wrong vector length": (_bad(vector=[1.0, 2.0]), r"steer\[0\]\.vector: expected 128 floats"),
    "nan": (_bad(vector=[math.nan] * 128), r"steer\[0\]\.vector\[0\]"),
    "inf scale": (_bad(scale=math.inf), r"steer\[0\]\.scale"),
    "unknown layer": (_bad(layers=[4]), r"steer\[0\]\.layers: layer 4 does not exist"),
    "negative layer": (_bad(layers=[-1]), r"steer\[0\]\.layers\[0\]"),
    "unknown hook": (_bad(hook="mlp_out"), r"steer\[0\]\.hook"),
    "unknown name": (_bad(vector="nope"), r"unknown vector name 'nope'"),
    "layer outside sites": (_bad(hook="pre_attn", layers=[2]), r"not a configured site"),
    "unknown field": ({"steer": [{"vector": vec(1), "layers": [1], "sclae": 2}]}, r"sclae"),
    "malformed json": ('{"steer": [', r"dynsteer: malformed JSON"),
    "gated site before monitor": (
        {"gate": {**GATE, "layer": 2, "steer": [{"vector": vec(1), "layers": [1]}]}},
        r"gate.steer\[0\].layers: .* comes before the monitor site"),
    "monitor site not configured": ({"gate": {**GATE, "hook": "post_attn"}},
                                    r"gate.layer: monitor site .* is not a configured site"),
    "not a monitor site": ({"gate": {**GATE, "layer": 0}},
                           r"gate.layer: post_block@0 is not a monitor site; add 'post_block@0' "
                           r"to the engine option dynsteer.monitor_sites"),
    "unknown probe": ({"gate": {**GATE, "probe": "nope"}}, r"gate.probe: unknown probe name"),
    "probe length": ({"gate": {**GATE, "probe": {"weights": [1.0]}}},
                     r"gate.probe.weights: expected 128 floats"),
    "bad sharpness": ({"gate": {**GATE, "sharpness": -1}}, r"gate.sharpness"),
    "not an object": ([1, 2], r"dynsteer: expected an object"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_rejected_and_engine_keeps_serving(llm, plain_outputs, case):
    """Bad specs fail at generate() with the field named; the next request is served."""
    spec, message = BAD_SPECS[case]
    with pytest.raises(ValueError, match=message):
        run(llm, PROMPTS[:1], [params(spec=spec)])
    (out,) = run(llm, PROMPTS[:1], [params()])
    assert_same_output(out, plain_outputs[0])


def test_rows_are_released_after_requests_finish(llm):
    """Rows return to the pool once their requests finish (no leak across batches)."""
    specs = [{"steer": [{"vector": vec(20 + i), "layers": [1]}]} for i in range(4)]
    run(llm, PROMPTS, [params(spec=s) for s in specs])
    run(llm, PROMPTS[:1], [params()])  # the next step processes the finished requests
    info = Steering(llm).info()[0]
    assert info["rows_in_use"] == 0
    assert info["live_requests"] <= 1


HOSTILE = {
    # The hostile-client probe's request: every number passed the old checks.
    "1e20 x 1e20": ({"steer": [{"vector": [1e20] * 128, "layers": [1], "scale": 1e20}]},
                    r"steer\[0\]: ‖scale · vector‖ = .* exceeds the engine's max_steer_norm"),
    "1e39 (inf in fp32)": (_bad(vector=[1e39] * 128),
                           r"steer\[0\]\.vector\[0\]: 1e\+39 is not finite in float32"),
    "1e39 scale": (_bad(scale=1e39), r"steer\[0\]\.scale: 1e\+39 is not finite in float32"),
    "numeric strings": (_bad(vector=["1.0"] * 128), r"steer\[0\]\.vector\[0\]"),
    "booleans": (_bad(vector=[True] * 128), r"steer\[0\]\.vector\[0\]"),
    "string layer": (_bad(layers=["1"]), r"steer\[0\]\.layers\[0\]"),
    "huge probe weights": ({"gate": {**GATE, "probe": {"weights": [1e30] * 128}}},
                           r"gate\.probe\.weights: magnitudes must be at most"),
    "huge threshold": ({"gate": {**GATE, "threshold": 1e30}}, r"gate\.threshold"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_request_is_rejected_and_later_requests_are_unchanged(llm, plain_outputs,
                                                                       case):
    """Numbers that would overflow where they are used are refused with the field named; the
    unrelated requests after them are exactly stock vLLM's."""
    spec, message = HOSTILE[case]
    with pytest.raises(ValueError, match=message):
        run(llm, PROMPTS[:1], [params(spec=spec)])
    for out, ref in zip(run(llm, PROMPTS, [params() for _ in PROMPTS]), plain_outputs,
                        strict=True):
        assert_same_output(out, ref)


def test_one_value_one_error_on_every_path(llm):
    """The same unusable value gets the same error, field named, on every way in."""
    steering = Steering(llm)
    fragment = "1e+39 is not finite in float32"
    with pytest.raises(ValueError, match=r"dynsteer\.steer\[0\]\.vector\[0\]: 1e\+39") as e:
        run(llm, PROMPTS[:1], [params(spec=_bad(vector=[1e39] * 128))])
    assert fragment in str(e.value)
    for call, field in ((lambda: steering.set_global(_bad(vector=[1e39] * 128)["steer"]),
                         "steer[0].vector[0]"),
                        (lambda: steering.register_vector("big", [1e39] * 128), "vector[0]"),
                        (lambda: steering.register_probe("big", weights=[1e39] * 128),
                         "weights[0]")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(f"{field}: {fragment}"), str(e.value)
    assert "big" not in steering.vectors() and "big" not in steering.probes()
    assert Steering(llm).info()[0]["global_entries"] == 0


def test_data_plane_drops_overflowing_steering(llm, plain_outputs):
    """Defence in depth: rows that reach the workers unchecked (here written with the raw
    worker RPC, bypassing the frontend) cannot push NaN, inf or overflowing values into the
    stream, so neither the steered requests nor the ones after them (which reuse their KV
    blocks) change. Before the op's guard, the later requests came back NaN."""
    poisons = [
        [{"vector": [1e30] * 128, "layers": [1, 2], "scale": 1e30}],  # inf in the fp32 row
        [{"vector": [1e30] * 128, "layers": [1]}],  # finite, but overflows the next norm
    ]
    steered_before = Steering(llm).info()[0]["requests_steered_total"]
    try:
        for entries in poisons:
            wire = [entry_to_wire(e) for e in parse_entries(entries)]
            raw_set_global(llm, wire)
            for out, ref in zip(run(llm, PROMPTS, [params() for _ in PROMPTS]), plain_outputs,
                                strict=True):
                assert_same_output(out, ref)
    finally:
        raw_set_global(llm, [])
    steered = Steering(llm).info()[0]["requests_steered_total"] - steered_before
    assert steered == len(poisons) * len(PROMPTS), "the poisoned rows never reached a request"
    for out, ref in zip(run(llm, PROMPTS, [params() for _ in PROMPTS]), plain_outputs,
                        strict=True):
        assert_same_output(out, ref)
