"""A request's own activations (its spec's ``capture``): a real engine against HF transformers.

A tiny Llama (fp32, compiled) behind the offline ``LLM``: each request's captured rows, prompt
and generated positions, equal the stream HF records over the same tokens with the same
steering (static, phase-specific and gated, upstream of the site), for every form of
``positions``, under chunked prefill and through the prefix cache. The worker's lanes and rows
are checked without an engine first.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_utils import params, run, start_llm, stop_llm
from hf_reference import CAPTURE_ATOL, load_hf, record_streams
from tiny_models import HIDDEN, vec

from dynsteer.capture import open as open_store
from dynsteer.controller.activations import (
    Activations,
    activations_of_stream,
    from_json,
    projection_matrix,
    quantize_int8,
    rows_from_bytes,
    rows_to_bytes,
    to_json,
)
from dynsteer.controller.extra_args import ACTIVATIONS_KEY
from dynsteer.controller.positions import first_prompt_position, select
from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.frontend import rows_inbox
from dynsteer.engine_ext.worker.sites import SiteOp
from dynsteer.engine_ext.worker.state import SteeringState

pytestmark = pytest.mark.usefixtures("engines_without_inductor")

SITES = "pre_attn@*,post_attn@1,post_block@*"
CAPTURED = ["pre_attn@0", "post_attn@1", "post_block@3"]


# ---- positions (no engine) -----------------------------------------------------------------
@pytest.mark.parametrize(("positions", "want"), [
    ("all", list(range(9))),
    ("prompt", [0, 1, 2, 3, 4]),
    ("generated", [5, 6, 7, 8]),
    ("last_prompt", [4]),
    ([0, -1, 7, 40, -9], [0, 4, 7]),
    (["1:3", "-2:", ":1"], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
    (["-2:6", "7:"], [3, 4, 5, 7, 8]),
    ([":-4"], [0]),
])
def test_positions_select_among_the_computed(positions, want):
    """A 5-token prompt that generated 5 tokens computed positions 0..8."""
    assert select(positions, 5, 9).tolist() == want


@pytest.mark.parametrize(("positions", "first"), [
    ("all", 0), ("prompt", 0), ("generated", None), ("last_prompt", 4), ([7, -2], 3),
    (["6:"], None), ([":2"], 0), ([-9], None)])
def test_first_prompt_position(positions, first):
    assert first_prompt_position(positions, 5) == first


# ---- encodings (no engine) -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_json_round_trip_keeps_each_dtypes_values(dtype):
    """``to_json`` / ``from_json`` give back exactly the values a dtype holds."""
    rows = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32) * 3
    data, scales = rows_to_bytes(rows, dtype)
    held = rows_from_bytes(data, dtype, rows.shape, scales)
    acts = Activations(status="ok", positions=np.arange(5), sites={"post_block@1": held},
                       dtype=dtype)
    back = from_json(json.loads(json.dumps(to_json(acts))))
    np.testing.assert_array_equal(back["post_block@1"], held)
    assert back.positions.tolist() == list(range(5)) and back.dtype == dtype


def test_a_streams_events_join_per_choice_in_position_order():
    """Each choice's parts (by their ``index``, in any event order) join into its positions
    and rows in order, with the worst status; an event without ``dynsteer`` is skipped."""
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)

    def part(index, first, count, status="ok"):
        acts = Activations(status=status, positions=np.arange(first, first + count),
                           sites={"post_block@1": rows[first:first + count]}, dtype="float32")
        return {**to_json(acts), "index": index}

    def event(*parts):
        return {"object": "dynsteer.activations", "choices": [],
                "dynsteer": {"activations": list(parts)}}

    found = activations_of_stream([
        event(part(1, 0, 2), part(0, 0, 3, "partial")), {"choices": [{"index": 0}]},
        event(part(0, 3, 0), part(1, 2, 4)), event(part(1, 6, 0), part(0, 3, 3))])
    assert found[0].status == "partial" and found[1].status == "ok"
    for acts in found.values():
        assert acts.positions.tolist() == list(range(6))
        np.testing.assert_array_equal(acts["post_block@1"], rows)


def test_int8_error_is_within_half_a_scale():
    rows = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    rows[3] = 0.0
    q, scale = quantize_int8(rows)
    assert np.all(np.abs(q.astype(np.float32) * scale[:, None] - rows)
                  <= scale[:, None] / 2 * (1 + 1e-6))
    assert scale[3] == 1.0 and not q[3].any()


def test_projection_keeps_norms_as_johnson_lindenstrauss_bounds():
    """With k = 512, squared norms stay within 1 +- 0.35 (the bound's failure probability
    per row is 2 exp(-512 * 0.35^2 / 8) < 1e-3); the matrix is the seed's, every time."""
    hidden, k = 4096, 512
    rows = np.random.default_rng(2).standard_normal((32, hidden)).astype(np.float32)
    m = projection_matrix(7, hidden, k)
    np.testing.assert_array_equal(m, projection_matrix(7, hidden, k))
    ratio = (np.linalg.norm(rows @ m, axis=1) / np.linalg.norm(rows, axis=1)) ** 2
    assert np.all(np.abs(ratio - 1) < 0.35)
    assert not np.array_equal(m, projection_matrix(8, hidden, k))


@pytest.mark.parametrize(("capture", "nbytes"), [
    ({"sites": "post_block@1,post_block@2"}, 2 * 29 * HIDDEN * 4),
    ({"sites": "post_block@1", "positions": "generated", "dtype": "float16"}, 19 * HIDDEN * 2),
    ({"sites": "post_block@1", "dtype": "int8", "project": {"k": 16}}, 29 * (16 + 4)),
    ({"sites": "post_block@1", "reduce": "mean"}, HIDDEN * 4),
])
def test_a_capture_returning_more_than_the_byte_cap_is_refused_naming_it(capture, nbytes):
    """A request's rows (sites x the positions it may compute x a row's bytes) are checked
    against ``capture_max_bytes`` at admission; a capture into a sink is not."""
    from dynsteer.controller.spec import CaptureSpec, ModelShape
    from dynsteer.engine_ext.compat.frontend import Generation
    from dynsteer.engine_ext.frontend import request_capture
    from dynsteer.engine_ext.options import EngineOptions

    sites = frozenset(("post_block", layer) for layer in range(4))
    shape = ModelShape(hidden_size=HIDDEN, num_layers=4, sites=sites, monitor_sites=sites)
    spec = CaptureSpec.model_validate(capture)

    def admit(cap: int, sink: str | None = None):
        options = EngineOptions(sites="post_block@*", monitor_sites="post_block@*",
                                capture_max_bytes=cap, capture_sinks={"acts": "/tmp/x"})
        return request_capture.admit(spec.model_copy(update={"sink": sink}), shape, options,
                                     10, Generation(20))

    assert admit(nbytes)["rows"] == 29
    with pytest.raises(ValueError, match=rf"^dynsteer\.capture: the request may return "
                                         rf"{nbytes} bytes .*at most {nbytes - 1} per capture "
                                         r"\(dynsteer\.capture_max_bytes\)"):
        admit(nbytes - 1)
    if "reduce" not in capture:
        assert admit(1024, sink="acts")["sink"] == "acts"


# ---- worker lanes and rows (no engine) -----------------------------------------------------
WORKER_SITES = (("pre_attn", 0), ("post_block", 0), ("post_block", 1))


def collected(capture, request_id, reply=True):
    """A worker's reply for one request (rows inline), None where it has none."""
    found = capture.collect_requests([(request_id, None, 0)], reply=reply)
    return found and found["items"][0]


def wanted(sites, rows, positions="all", dtype="float32"):
    return {ACTIVATIONS_KEY: {"sites": sites, "rows": rows, "positions": positions,
                              "dtype": dtype}}


def test_lanes_are_shared_by_site_and_freed_when_collected():
    state = SteeringState(WORKER_SITES, 4, max_rows=4, max_tokens=32, max_slots=8,
                          device=torch.device("cpu"), capture_lanes=2, capture_tokens=40)
    capture = state.capture
    state.add_request("a", 1, wanted(["post_block@1"], 6), prompt_len=3)
    state.add_request("b", 2, wanted(["post_block@1", "pre_attn@0"], 6), prompt_len=3)
    assert capture.site_lane.tolist() == [1, -1, 0]
    state.add_request("c", 3, wanted(["post_block@0"], 6), prompt_len=3)  # no free lane
    state.remove_request("a")
    assert collected(capture, "a", reply=True)["status"] == "ok"
    assert collected(capture, "c", reply=True)["detail"].startswith(
        "no free capture lanes")
    assert collected(capture, "nobody", reply=True) is None
    state.remove_request("b")
    collected(capture, "b", reply=False)
    assert capture.site_lane.tolist() == [-1, -1, -1] and capture.rows_in_use == 0


def test_lanes_of_finished_uncollected_requests_are_reused_oldest_first():
    """A request that needs a lane no live request holds takes the lanes (and rows) of the
    uncollected request that left the batch longest ago; a live request's lane is never
    taken."""
    state = SteeringState(WORKER_SITES, 4, max_rows=4, max_tokens=32, max_slots=8,
                          device=torch.device("cpu"), capture_lanes=2, capture_tokens=40)
    capture = state.capture
    state.add_request("a", 1, wanted(["post_block@1"], 4), prompt_len=2)
    state.add_request("b", 2, wanted(["pre_attn@0"], 4), prompt_len=2)
    state.remove_request("a")
    state.add_request("c", 3, wanted(["post_block@0"], 4), prompt_len=2)  # takes a's lane
    assert capture.site_lane.tolist() == [1, 0, -1]
    assert collected(capture, "a")["status"] == "dropped"
    state.add_request("d", 4, wanted(["post_block@1"], 4), prompt_len=2)  # b and c are live
    assert collected(capture, "d")["detail"].startswith("no free capture lanes")
    assert collected(capture, "b")["status"] == "ok"


def test_rows_of_finished_requests_are_reused_oldest_first():
    """A request that needs room takes the rows of the request that left longest ago."""
    state = SteeringState(WORKER_SITES, 4, max_rows=4, max_tokens=32, max_slots=8,
                          device=torch.device("cpu"), capture_lanes=1, capture_tokens=10)
    for i, req in enumerate(("a", "b")):
        state.add_request(req, i + 1, wanted(["post_block@1"], 5), prompt_len=2)
    state.remove_request("b")
    state.remove_request("a")
    state.add_request("c", 3, wanted(["post_block@1"], 4), prompt_len=2)
    assert collected(state.capture, "b", reply=True)["status"] == "dropped"
    assert collected(state.capture, "a", reply=True)["status"] == "ok"


def step(state, slot, first, count):
    """One step of one request: positions ``first .. first + count - 1``, each site's stream
    at a token the token's position (as the model's forward would write it)."""
    state.fill(np.array([slot]), np.array([first]), np.array([count]))
    x = torch.arange(first, first + count, dtype=torch.float32)[:, None].expand(-1, 4)
    for buffers in state.site_buffers().values():
        SiteOp(buffers)(x.contiguous(), torch.zeros_like(x))


def test_a_stream_reads_rows_as_they_are_computed_and_collecting_frees_them():
    """Reading with ``keep`` returns a running request's rows computed since ``since`` and
    frees nothing; a capture whose rows do not stream (a gated one) gives None then; the final
    collect returns what is left and frees it."""
    state = SteeringState(WORKER_SITES, 4, max_rows=4, max_tokens=32, max_slots=8,
                          device=torch.device("cpu"), capture_lanes=2, capture_tokens=40)
    capture = state.capture
    streamed = {"sites": ["post_block@1"], "rows": 6, "positions": "all", "dtype": "float32",
                "stream": True}
    state.add_request("a", 1, {ACTIVATIONS_KEY: streamed}, prompt_len=3)
    state.add_request("g", 2, {ACTIVATIONS_KEY: {**streamed, "when": "gated",
                                                  "stream": False}}, prompt_len=3)

    def read(since, keep=True, others=("g",)):
        found = capture.collect_requests([("a", None, since), *((o, None, 0) for o in others)],
                                         reply=True, keep=keep)["items"]
        rows = rows_from_bytes(found[0]["data"], "float32", (1, found[0]["rows"], 4))
        positions = np.frombuffer(found[0]["positions"], "<i8").tolist()
        assert rows[0, :, 0].tolist() == positions  # each row is its own position's
        return positions, *found[1:]

    step(state, 1, 0, 3)
    assert read(0) == ([0, 1, 2], None)
    step(state, 1, 3, 1)
    assert read(3) == ([3], None) and read(0)[0] == [0, 1, 2, 3]
    assert capture.rows_in_use == 12
    state.remove_request("a")
    assert read(2, keep=False, others=()) == ([2, 3],)
    assert collected(capture, "a") is None and capture.rows_in_use == 6


# ---- a real engine vs HF -------------------------------------------------------------------
LENGTHS = [5, 12, 9, 70]
"""The 70-token prompt is prefilled in chunks (64 tokens a step)."""
PROMPTS = [[1, *np.random.RandomState(n).randint(3, 500, n - 1).tolist()] for n in LENGTHS]
DECODE = 6


@pytest.fixture(scope="module")
def sink_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-sink")


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("audit-sink")


AUDIT = {"sites": ["post_block@2"], "when": "gated", "sink": "audit", "dtype": "float16"}
"""The engine's global capture: every gated request that asks for no capture, if it fired."""


@pytest.fixture(scope="module")
def llm(tiny_model_dir, sink_dir, audit_dir):
    engine = start_llm(tiny_model_dir("llama"), max_num_batched_tokens=64, block_size=32,
                       enable_prefix_caching=True,
                       dynsteer={"sites": SITES, "monitor_sites": SITES, "capture_lanes": 4,
                                 "capture_tokens": 200,
                                 "capture_sinks": {"disk": f"{sink_dir}?shard_bytes=65536",
                                                   "audit": str(audit_dir)},
                                 "global_capture": AUDIT},
                       in_process=True)
    yield engine
    stop_llm(engine)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf(tiny_model_dir("llama"))


def captured(llm, prompts, spec, max_tokens=DECODE, **kwargs):
    """Outputs and their activations, collected as they arrive."""
    kwargs.setdefault("prompt_logprobs", None)
    outs = run(llm, prompts, [params(max_tokens, spec=spec, **kwargs) for _ in prompts])
    return outs, Steering(llm).activations(outs)


def assert_rows_match_hf(hf, out, acts, spec, sites=CAPTURED):
    """Every captured site's rows equal HF's stream at the same positions."""
    tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
    streams = record_streams(hf, tokens, spec.get("steer", ()), gate=spec.get("gate"),
                             prompt_len=len(out.prompt_token_ids))
    assert acts.status == "ok", acts.detail
    assert sorted(acts.sites) == sorted(sites)
    for site in sites:
        hook, layer = site.split("@")
        want = streams[(hook, int(layer))][acts.positions]
        assert acts[site].shape == (len(acts.positions), HIDDEN)
        np.testing.assert_allclose(acts[site], want, atol=CAPTURE_ATOL, err_msg=site)


@pytest.mark.engine
def test_static_steering_upstream_prompt_and_generated_rows_match_hf(llm, hf):
    """Prompt and generated rows under static steering (one entry decode-only), every
    request of a batch whose longest prompt is prefilled in chunks."""
    spec = {"steer": [{"vector": vec(3), "layers": [0, 2]},
                      {"vector": vec(4), "layers": [1], "hook": "post_attn", "phase": "decode"}],
            "capture": {"sites": CAPTURED}}
    outs, acts = captured(llm, PROMPTS, spec)
    for out, act in zip(outs, acts, strict=True):
        n = len(out.prompt_token_ids) + DECODE - 1
        assert act.positions.tolist() == list(range(n))
        assert_rows_match_hf(hf, out, act, spec)


def sampled(max_tokens, spec, n):
    """Parameters of ``n`` completions sampled apart (seeded)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=5, detokenize=False,
                          ignore_eos=True, extra_args={"dynsteer": spec})


@pytest.mark.engine
def test_each_of_n_sampled_completions_captures_its_own_rows(llm, hf):
    """``n = 3`` completions of one prompt are requests of their own: each one's rows (the
    prompt, and its own generated tokens) equal HF's under static steering, the result a
    list in the order of their ``index``."""
    spec = {"steer": [{"vector": vec(3), "layers": [0, 2]}], "capture": {"sites": CAPTURED}}
    out, = run(llm, PROMPTS[1:2], [sampled(DECODE, spec, n=3)])
    acts = Steering(llm).activations(out)
    completions = sorted(out.outputs, key=lambda c: c.index)
    assert isinstance(acts, list) and len(acts) == 3
    assert len({tuple(c.token_ids) for c in completions}) > 1
    for completion, act in zip(completions, acts, strict=True):
        one = SimpleNamespace(prompt_token_ids=out.prompt_token_ids, outputs=[completion])
        assert act.positions.tolist() == list(range(len(out.prompt_token_ids) + DECODE - 1))
        assert_rows_match_hf(hf, one, act, spec)
    assert Steering(llm).activations(out) == [None, None, None]  # collected: freed


@pytest.mark.engine
def test_gated_steering_upstream_rows_match_hf(llm, hf):
    spec = {"gate": {"probe": {"weights": vec(7, norm=1.0), "threshold": 0.0}, "layer": 1,
                     "steer": [{"vector": vec(8), "layers": [2, 3]}]},
            "capture": {"sites": CAPTURED, "positions": "generated"}}
    outs, acts = captured(llm, PROMPTS[:3], spec)
    for out, act in zip(outs, acts, strict=True):
        prompt = len(out.prompt_token_ids)
        assert act.positions.tolist() == list(range(prompt, prompt + DECODE - 1))
        assert_rows_match_hf(hf, out, act, spec)


@pytest.mark.engine
def test_conditional_capture_keeps_exactly_the_requests_whose_gate_fired(llm, hf):
    """``when: "gated"``: of a batch, the requests whose gate fired (threshold far below their
    scores) keep their rows, equal to HF's; the others (threshold far above) are skipped."""
    def spec(threshold):
        return {"gate": {"probe": {"weights": vec(7, norm=1.0), "threshold": threshold},
                         "layer": 1, "steer": [{"vector": vec(8), "layers": [2, 3]}]},
                "capture": {"sites": ["post_block@3"], "when": "gated"}}

    specs = [spec(-1e4), spec(1e4), spec(-1e4), spec(1e4)]
    outs = run(llm, PROMPTS, [params(DECODE, spec=s, prompt_logprobs=None) for s in specs])
    steering = Steering(llm)
    found = [steering.activations(out) for out in outs]
    assert [a.status for a in found] == ["ok", "skipped", "ok", "skipped"]
    for out, act, s in zip(outs, found, specs, strict=True):
        fired = steering.telemetry(out)["gated_prefill"] > 0
        assert fired == (act.status == "ok")
        if fired:
            assert_rows_match_hf(hf, out, act, s, ["post_block@3"])
        else:
            assert act.sites == {} and len(act.positions) == 0
    assert steering.info()[0]["capture_rows_in_use"] == 0


UPSTREAM = {
    "unsteered": {},
    "static": {"steer": [{"vector": vec(3), "layers": [0, 1]}]},
    "gated": {"gate": {"probe": {"weights": vec(7, norm=1.0), "threshold": 0.0}, "layer": 0,
                       "steer": [{"vector": vec(8), "layers": [1, 2]}]}},
}
"""Steering upstream of the captured site (``post_block@2``), or none."""


@pytest.mark.engine
@pytest.mark.parametrize("upstream", list(UPSTREAM))
@pytest.mark.parametrize("positions", ["prompt", "generated", "last_prompt",
                                       [0, -1, "2:4", "-3:"]])
def test_positions_forms_match_hf(llm, hf, positions, upstream):
    """Every positions form, with no steering, static or gated steering upstream of the
    site: the positions it names among those computed, HF's rows there."""
    spec = {**UPSTREAM[upstream],
            "capture": {"sites": ["post_block@2"], "positions": positions}}
    outs, acts = captured(llm, PROMPTS[1:3], spec)
    for out, act in zip(outs, acts, strict=True):
        prompt = len(out.prompt_token_ids)
        want = select(positions, prompt, prompt + DECODE - 1)
        assert act.positions.tolist() == want.tolist()
        assert_rows_match_hf(hf, out, act, spec, ["post_block@2"])


@pytest.mark.engine
def test_a_mean_is_one_row_per_site_the_mean_of_hfs_rows(llm, hf):
    """``reduce: "mean"``: one row per site, the mean of HF's rows at the positions captured
    (listed as usual), under steering upstream; over JSON too."""
    spec = {"steer": [{"vector": vec(3), "layers": [0]}],
            "capture": {"sites": CAPTURED, "positions": ["1:"], "reduce": "mean"}}
    outs, acts = captured(llm, PROMPTS[1:3], spec)
    for out, act in zip(outs, acts, strict=True):
        tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
        streams = record_streams(hf, tokens, spec["steer"])
        assert act.status == "ok" and act.positions.tolist() == list(range(1, len(tokens)))
        for site in CAPTURED:
            hook, layer = site.split("@")
            want = streams[(hook, int(layer))][act.positions].mean(axis=0, keepdims=True)
            assert act[site].shape == (1, HIDDEN)
            np.testing.assert_allclose(act[site], want, atol=CAPTURE_ATOL, err_msg=site)
        back = from_json(json.loads(json.dumps(to_json(act))))
        np.testing.assert_array_equal(back[CAPTURED[0]], act[CAPTURED[0]])


@pytest.mark.engine
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_round_the_float32_rows(llm, dtype):
    spec = {"capture": {"sites": ["post_block@3"], "dtype": dtype}}
    _, (full,) = captured(llm, PROMPTS[:1], {"capture": {"sites": ["post_block@3"]}})
    _, (half,) = captured(llm, PROMPTS[:1], spec)
    rows = half["post_block@3"].astype(np.float32)
    # float16 keeps 11 significant bits, bfloat16 8.
    rtol = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    np.testing.assert_allclose(rows, full["post_block@3"], rtol=rtol, atol=1e-6)
    assert half.dtype == dtype and not np.array_equal(rows, full["post_block@3"])


@pytest.mark.engine
def test_a_window_keeps_the_positions_around_the_gates_first_firing(llm, hf):
    """``window: [before, after]``: of a gated capture, only the positions around the first
    one whose gate fired (the telemetry's ``first_gated``, where the traced score first
    exceeds the threshold), equal to HF's rows there."""
    probe = {"weights": vec(7, norm=1.0), "threshold": -1e4}
    gate = {"probe": probe, "layer": 1, "trace": True,
            "steer": [{"vector": vec(8), "layers": [2, 3]}]}
    prompt = PROMPTS[1]
    out, = run(llm, [prompt], [params(DECODE, spec={"gate": gate}, prompt_logprobs=None)])
    scores = np.array(Steering(llm).telemetry(out)["scores"])
    threshold = float(np.sort(scores[2:])[-2])  # fires first where a larger score comes
    first = int(np.flatnonzero(scores > threshold)[0])
    spec = {"gate": {**gate, "probe": {**probe, "threshold": threshold}},
            "capture": {"sites": CAPTURED, "when": "gated", "window": [2, 1]}}
    outs, (act,) = captured(llm, [prompt], spec)
    assert Steering(llm).telemetry(outs[0])["first_gated"] == first
    assert act.status == "ok"
    assert act.positions.tolist() == list(range(max(first - 2, 0), first + 2))
    assert_rows_match_hf(hf, outs[0], act, spec)
    with pytest.raises(ValueError, match=r"capture\.window: .*needs when: 'gated'"):
        run(llm, [prompt], [params(3, spec={"capture": {"sites": CAPTURED,
                                                        "window": [1, 1]}})])


@pytest.mark.engine
def test_a_batch_comes_through_the_inbox_or_inline_alike(llm, monkeypatch):
    """A batch collected in one call: its rows travel through the frontend's inbox (one file,
    unlinked once mapped) or, where the workers cannot see one, inline in the reply; the same
    rows either way, and writable."""
    spec = {"capture": {"sites": CAPTURED, "dtype": "float16"}}
    taken = []
    take = rows_inbox.take
    monkeypatch.setattr(rows_inbox, "take", lambda path: taken.append(path) or take(path))
    outs, mapped = captured(llm, PROMPTS, spec)
    assert len(taken) == 1 and os.listdir(rows_inbox.inbox()["folder"]) == ["token"]
    monkeypatch.setattr(rows_inbox, "inbox", lambda: None)
    again, inline = captured(llm, PROMPTS, spec)
    assert len(taken) == 1
    for first, second, a, b in zip(outs, again, mapped, inline, strict=True):
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
        assert a.status == b.status == "ok" and (a.positions == b.positions).all()
        for site in CAPTURED:
            np.testing.assert_allclose(a[site], b[site], atol=1e-6, err_msg=site)
            a[site][0, 0] = b[site][0, 0] = 0.0


@pytest.mark.engine
def test_int8_and_projected_rows_are_the_float32_rows_encoded(llm):
    """int8 rows are within half a scale of the float32 rows; projected rows equal the float32
    rows times the seed's matrix, then cast."""
    _, (full,) = captured(llm, PROMPTS[1:2], {"capture": {"sites": CAPTURED}})
    _, (q,) = captured(llm, PROMPTS[1:2], {"capture": {"sites": CAPTURED, "dtype": "int8"}})
    _, (p,) = captured(llm, PROMPTS[1:2], {"capture": {
        "sites": CAPTURED, "project": {"k": 32, "seed": 5}, "dtype": "float16"}})
    m = projection_matrix(5, HIDDEN, 32)
    for site in CAPTURED:
        rows = full[site]
        half_scale = np.abs(rows).max(axis=1, keepdims=True) / 254
        assert np.all(np.abs(q[site] - rows) <= half_scale * (1 + 1e-5))
        assert p[site].shape == (len(full.positions), 32) and p[site].dtype == np.float16
        np.testing.assert_allclose(p[site], rows @ m, rtol=2e-3, atol=2e-3)


@pytest.mark.engine
def test_cached_prefix_is_recomputed_from_the_first_captured_position(llm, hf):
    """A prompt served before (its blocks cached) is captured whole: the capturing request
    computes its prompt itself. Capturing only generated positions leaves the cache alone."""
    prompt = PROMPTS[3]
    run(llm, [prompt], [params(2, prompt_logprobs=None)])
    again, = run(llm, [prompt], [params(2, prompt_logprobs=None)])
    assert again.num_cached_tokens == 64, "the prompt's two full blocks should be cached"
    spec = {"capture": {"sites": CAPTURED}}
    outs, (act,) = captured(llm, [prompt], spec)
    assert outs[0].num_cached_tokens == 0
    assert act.positions.tolist() == list(range(len(prompt) + DECODE - 1))
    assert_rows_match_hf(hf, outs[0], act, spec)
    spec = {"capture": {"sites": CAPTURED, "positions": ["40:"]}}
    outs, (act,) = captured(llm, [prompt], spec)
    assert outs[0].num_cached_tokens == 32  # the block holding position 40 is recomputed
    assert act.positions[0] == 40
    assert_rows_match_hf(hf, outs[0], act, spec)
    spec = {"capture": {"sites": CAPTURED, "positions": "generated"}}
    outs, (act,) = captured(llm, [prompt], spec)
    assert outs[0].num_cached_tokens == again.num_cached_tokens
    assert_rows_match_hf(hf, outs[0], act, spec)


@pytest.mark.engine
def test_uncaptured_requests_and_errors(llm):
    steering = Steering(llm)
    out, = run(llm, PROMPTS[:1], [params(3)])
    assert steering.activations(out) is None
    for capture, message in [
        ({"sites": "post_attn@2"}, r"dynsteer\.capture\.sites: post_attn@2 is not a monitor "),
        ({"sites": "post_block@*,pre_attn@*"}, r"dynsteer\.capture\.sites: 8 sites; this "
                                              r"engine captures at most 4"),
        ({"sites": "post_block@1", "positions": "some"}, r"dynsteer\.capture\.positions"),
        ({"sites": "post_block@1", "when": "gated"}, r"dynsteer\.capture\.when: 'gated' keeps"),
        ({"sites": "post_block@1", "when": "later"}, r"dynsteer\.capture\.when"),
        ({"sites": "post_block@1", "project": {"k": 129}},
         r"dynsteer\.capture\.project\.k: 129 is more than the model's hidden size \(128\)"),
        ({"sites": "post_block@1", "reduce": "max"}, r"dynsteer\.capture\.reduce"),
        ({"sites": "post_block@1", "sink": "acts", "reduce": "mean"},
         r"dynsteer\.capture\.reduce: .*a reduced capture is returned with the output"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(llm, PROMPTS[:1], [params(3, spec={"capture": capture})])
    with pytest.raises(ValueError, match=r"needs 254 capture rows .*dynsteer\.capture_tokens"):
        run(llm, PROMPTS[:1], [params(250, spec={"capture": {"sites": "post_block@1"}})])
    with pytest.raises(ValueError, match=r"needs 256 capture rows \(4 completions x prompt 5 "
                                         r"\+ max_tokens 60 - 1\).*dynsteer\.capture_tokens"):
        run(llm, PROMPTS[:1], [sampled(60, {"capture": {"sites": "post_block@1"}}, n=4)])
    out, = run(llm, PROMPTS[:1], [params(3)])  # still serving
    assert len(out.outputs[0].token_ids) == 3


# ---- the engine's own sink ------------------------------------------------------------------
def sunk(llm, sink_dir, outs):
    """The requests of ``outs`` as the engine's sink holds them, after sealing."""
    totals = Steering(llm).flush_capture_sinks()["disk"]
    store = {r.request_id: r for r in open_store(sink_dir)}
    assert totals["requests"] == sum(1 for _ in open_store(sink_dir))
    return [store.get(out.request_id) for out in outs]


@pytest.mark.engine
def test_an_engine_sink_holds_the_rows_hf_computes(llm, hf, sink_dir):
    """Rows written by the worker as the requests run (the 70-token prompt's first chunk,
    then stretches of generated positions, the rest when each finishes), under static
    steering upstream: read back, every site equals HF's stream; a collect says where they
    went and the worker keeps none."""
    spec = {"steer": [{"vector": vec(3), "layers": [0, 2]}],
            "capture": {"sites": CAPTURED, "sink": "disk"}}
    outs = run(llm, PROMPTS, [params(max_tokens, spec=spec, prompt_logprobs=None)
                              for max_tokens in (40, 6, 40, 3)])
    said = Steering(llm).activations(outs)
    assert all(a.status == "ok" and a.sites == {} and "disk" in a.detail for a in said)
    for out, got in zip(outs, sunk(llm, sink_dir, outs), strict=True):
        assert got is not None and got.status == "ok"
        n = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert got.activations.positions.tolist() == list(range(n))
        assert_rows_match_hf(hf, out, got.activations, spec)
    assert Steering(llm).info()[0]["capture_rows_in_use"] == 0


@pytest.mark.engine
def test_an_engine_sink_keeps_only_gated_requests_whose_gate_fired(llm, hf, sink_dir):
    """``when: "gated"`` into the sink, in float16 at some positions: the requests whose gate
    fired are there with HF's rows (to float16's precision), the others are not."""
    def spec(threshold):
        return {"gate": {"probe": {"weights": vec(7, norm=1.0), "threshold": threshold},
                         "layer": 1, "steer": [{"vector": vec(8), "layers": [2, 3]}]},
                "capture": {"sites": ["post_block@3"], "when": "gated", "sink": "disk",
                            "positions": [0, "2:4", -1], "dtype": "float16"}}

    specs = [spec(-1e4), spec(1e4), spec(-1e4)]
    outs = run(llm, PROMPTS[:3], [params(DECODE, spec=s, prompt_logprobs=None) for s in specs])
    got = sunk(llm, sink_dir, outs)
    assert [g is not None for g in got] == [True, False, True]
    for out, found, s in zip(outs, got, specs, strict=True):
        if found is None:
            continue
        prompt = len(out.prompt_token_ids)
        assert found.activations.positions.tolist() == select(
            [0, "2:4", -1], prompt, prompt + DECODE - 1).tolist()
        tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
        want = record_streams(hf, tokens, (), gate=s["gate"], prompt_len=prompt)[
            ("post_block", 3)][found.activations.positions]
        np.testing.assert_allclose(found["post_block@3"], want, rtol=2e-3, atol=2e-3)


@pytest.mark.engine
def test_a_gated_sink_capture_leaves_the_next_requests_values_intact(llm):
    """A finished gated capture is written once its gate decision is read, which folds the
    steps run so far; the step the engine begins next keeps its own per-token values (its
    request's trace is what it is without the capture before it)."""
    gate = {"probe": {"weights": vec(7, norm=1.0), "threshold": -1e4}, "layer": 1,
            "trace": True, "steer": [{"vector": vec(8), "layers": [2, 3]}]}
    audited = {"gate": gate, "capture": {"sites": ["post_block@3"], "when": "gated",
                                         "sink": "disk"}}

    plain = {"gate": gate, "capture": {"sites": ["post_block@1"]}}  # no global capture

    def traced(spec):
        out, = run(llm, PROMPTS[1:2], [params(DECODE, spec=spec, prompt_logprobs=None)])
        scores = Steering(llm).telemetry(out)["scores"]
        if spec is plain:
            Steering(llm).activations(out)
        return scores

    alone = traced(plain)
    traced(audited)  # written when the next step begins
    assert traced(plain) == alone


@pytest.mark.engine
def test_the_global_capture_records_requests_that_ask_for_none(llm, hf, audit_dir):
    """The engine option ``global_capture`` (gated, into a sink): a gated request without a
    capture of its own is recorded there with HF's rows if its gate fired; one whose gate did
    not fire, a plain one and one with its own capture are not."""
    gate = {"probe": {"weights": vec(7, norm=1.0), "threshold": -1e4}, "layer": 1,
            "steer": [{"vector": vec(8), "layers": [2, 3]}]}
    quiet = {**gate, "probe": {**gate["probe"], "threshold": 1e4}}
    specs = [{"gate": gate}, {"gate": quiet}, None,
             {"gate": gate, "capture": {"sites": ["post_block@1"]}}]
    outs = run(llm, PROMPTS[:4], [params(DECODE, spec=s, prompt_logprobs=None) for s in specs])
    assert Steering(llm).activations(outs[3]).status == "ok"
    totals = Steering(llm).flush_capture_sinks()["audit"]
    store = {r.request_id: r for r in open_store(audit_dir)}
    assert totals["requests"] == len(store)
    assert [out.request_id in store for out in outs] == [True, False, False, False]
    found, out = store[outs[0].request_id], outs[0]
    prompt = len(out.prompt_token_ids)
    tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
    assert found.activations.positions.tolist() == list(range(len(tokens)))
    want = record_streams(hf, tokens, (), gate=gate, prompt_len=prompt)[("post_block", 2)]
    np.testing.assert_allclose(found["post_block@2"], want, rtol=2e-3, atol=2e-3)


def test_a_global_capture_must_name_an_engine_sink():
    from dynsteer.engine_ext.options import EngineOptions

    for capture, message in [
        ({"sites": ["post_block@2"]}, r"global_capture\.sink: name one of capture_sinks "
                                      r"\(configured: audit\)"),
        ({"sites": ["post_block@2"], "sink": "elsewhere"}, r"global_capture\.sink"),
        ({"sites": ["post_block@2"], "sink": "audit", "dtype": "x"}, r"global_capture\.dtype"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineOptions(capture_sinks={"audit": "/tmp/audit"}, global_capture=capture)


@pytest.mark.engine
def test_an_unknown_sink_is_refused_naming_the_configured_ones(llm):
    with pytest.raises(ValueError, match=r"capture\.sink: 'nope' is not a capture sink.*disk"):
        run(llm, PROMPTS[:1], [params(DECODE, spec={"capture": {"sites": CAPTURED,
                                                              "sink": "nope"}})])
