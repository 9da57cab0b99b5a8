"""Activation capture through the engine: planner, worker buffers, and real engines vs HF.

Engine tests: a tiny Llama behind ``AsyncLLM`` (the API server's client, ``capture_async``) and a
tiny Qwen3 behind the offline ``LLM`` (``Steering.capture``), both compiled, fp32. Small
``capture_lanes`` / ``capture_tokens`` make every capture take several passes and rounds.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_utils import (
    ALL_SITES,
    assert_same_output,
    params,
    run,
    start_async_llm,
    start_llm,
    stop_async_llm,
    stop_llm,
)
from hf_reference import CAPTURE_ATOL, assert_capture_matches_hf, load_hf, record_streams
from tiny_models import HIDDEN, LAYERS, vec

from dynsteer.controller.contract import site_name
from dynsteer.controller.extra_args import CAPTURE_KEY
from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.frontend.capture import (
    _drive,
    _Generate,
    _protocol,
    _Rpc,
    capture_async,
    encode_result,
    parse_args,
    plan_capture,
)
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.worker.sites import SiteOp
from dynsteer.engine_ext.worker.state import SteeringState

pytestmark = pytest.mark.usefixtures("engines_without_inductor")

LENGTHS = [5, 11, 8, 17, 3, 9, 24]
PROMPTS = [[1, *np.random.RandomState(n).randint(3, 500, n - 1).tolist()] for n in LENGTHS]


def fake_frontend(sites: str = "post_block@*,post_attn@1", lanes: int = 2, tokens: int = 24):
    options = EngineOptions(sites=sites, monitor_sites=sites, capture_lanes=lanes,
                            capture_tokens=tokens)
    engine_sites = options.engine_sites(LAYERS)
    return SimpleNamespace(options=options, sites=engine_sites.all, monitors=engine_sites.monitor,
                           num_layers=LAYERS, hidden_size=HIDDEN)


def plan(prompts=PROMPTS, sites="post_block@*,post_attn@1", reduce="last", **kw):
    args = parse_args(prompts, sites, reduce)
    return plan_capture(args.prompts, args, fake_frontend(**kw))


# ---- planner ----------------------------------------------------------------------------
def test_plan_splits_rounds_by_capacity_and_passes_by_lanes():
    """Rounds hold at most capture_tokens prompt tokens, passes at most capture_lanes sites."""
    p = plan(tokens=24, lanes=2)
    assert p.rounds == [[0, 1, 2], [3, 4], [5], [6]]
    assert all(sum(LENGTHS[i] for i in r) <= 24 for r in p.rounds)
    assert p.passes == [["post_block@0", "post_attn@1"], ["post_block@1", "post_block@2"],
                        ["post_block@3"]]


def test_plan_items_are_uncacheable_prefill_only_requests():
    """Each item has a unique cache salt and capture key and generates one token."""
    p = plan()
    items = [it for r in range(len(p.rounds)) for it in p.round_items(1, r)]
    assert [it.index for it in items] == list(range(len(PROMPTS)))
    assert len({it.prompt["cache_salt"] for it in items}) == len(items)
    assert all(it.params.max_tokens == 1 for it in items)
    assert items[0].params.extra_args == {CAPTURE_KEY: f"{p.ticket}.1:0"}
    assert plan().ticket != p.ticket


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sites": "post_attn@2"}, r"sites: post_attn@2 is not a monitor site; add 'post_attn@2'"),
    ({"sites": "post_block@9"}, r"sites: layer 9 .* does not exist"),
    ({"sites": "mlp@1"}, r"sites: .*unknown hook 'mlp'"),
    ({"reduce": "max"}, r"^reduce: "),
    ({"prompts": [[1, 2], [1] * 25]},
     r"prompts\[1\]: 25 tokens exceed the capture capacity of 24 tokens; raise "
     r"dynsteer.capture_tokens"),
    ({"prompts": [[1, -3]]}, r"^prompts\[0\]\[1\]: "),
    ({"prompts": [[]]}, r"prompts\[0\]: empty prompt"),
    ({"prompts": []}, r"^prompts: "),
    ({"lanes": 0}, r"capture is off on this engine"),
])
def test_bad_arguments_raise_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_failed_round_still_ends_the_pass():
    """An engine call failing mid-capture ends the pass, then the error propagates."""
    calls = []

    def execute(step):
        calls.append(step)
        if isinstance(step, _Generate):
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        _drive(_protocol(plan()), execute)
    assert [c.method for c in calls if isinstance(c, _Rpc)] == [
        "dynsteer_capture_begin", "dynsteer_capture_end"]


class FakeLLM:
    """An offline-LLM stand-in whose "forward" writes stream = token id + 1000 * layer into a
    real worker state, so the whole protocol (passes, rounds, RPCs, assembly) runs without vLLM
    engines; its tokenizer maps each character to its code point."""

    def __init__(self, sites: str, lanes: int, tokens: int) -> None:
        self.frontend = fake_frontend(sites, lanes, tokens)
        self.state = SteeringState(self.frontend.sites, HIDDEN, max_rows=4, max_tokens=256,
                                   max_slots=64, device=torch.device("cpu"),
                                   capture_lanes=lanes, capture_tokens=tokens)
        self.seen: list[list[int]] = []

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [ord(ch) for ch in text])

    def collective_rpc(self, method, args=()):
        capture = self.state.capture
        call = {"dynsteer_capture_begin": capture.begin, "dynsteer_capture_end": capture.end,
                "dynsteer_capture_collect": lambda k, r: capture.collect(k, r, reply=True)}
        return [call[method](*args)]

    def generate(self, prompts, params, use_tqdm=False):
        ids = [f"r{i}" for i in range(len(prompts))]
        tokens = [p["prompt_token_ids"] for p in prompts]
        self.seen.extend(tokens)
        for i, (req, sp) in enumerate(zip(ids, params, strict=True)):
            self.state.add_request(req, i + 1, sp.extra_args, len(tokens[i]))
        lens = np.array([len(t) for t in tokens])
        self.state.fill(np.arange(1, len(ids) + 1), np.zeros(len(ids), np.int64), lens)
        flat = torch.tensor([t for p in tokens for t in p], dtype=torch.float32)
        for (_, layer), buffers in self.state.site_buffers().items():
            x = (flat + 1000 * layer)[:, None].expand(-1, HIDDEN).contiguous()
            SiteOp(buffers)(x, torch.zeros_like(x))
        for req in ids:
            self.state.remove_request(req)


def test_protocol_end_to_end_with_text_prompts(monkeypatch):
    """Texts are tokenized; every pass and round lands in the right prompt and site."""
    import dynsteer.engine_ext.frontend.capture as capture_module

    llm = FakeLLM("post_block@*,post_attn@1", lanes=2, tokens=6)
    monkeypatch.setattr(capture_module, "_frontend", lambda engine: engine.frontend)
    prompts = ["abc", [7, 8, 9, 10], "hello", [5]]
    out = capture_module.capture_sync(llm, prompts, "post_block@*,post_attn@1", "all")
    assert set(out) == {"post_attn@1", *(f"post_block@{i}" for i in range(LAYERS))}
    for site, arrays in out.items():
        layer = int(site.split("@")[1])
        for prompt, got in zip(prompts, arrays, strict=True):
            ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
            np.testing.assert_array_equal(got[:, 0], np.array(ids) + 1000 * layer)
    means = capture_module.capture_sync(llm, prompts, "post_block@2", "mean")["post_block@2"]
    np.testing.assert_allclose(means[:, 0], [98 + 2000, 8.5 + 2000, 106.4 + 2000, 5 + 2000])
    assert llm.state.capture.rows_in_use == 0 and llm.state.capture.ticket is None


def test_encode_result_is_json_with_dtype_and_shape():
    result = {"post_block@0": np.ones((2, 3), np.float32),
              "post_block@1": [np.zeros((4, 3), np.float32)]}
    out = encode_result(result)
    assert out["post_block@0"]["shape"] == [2, 3] and out["post_block@0"]["dtype"] == "float32"
    assert out["post_block@1"][0]["shape"] == [4, 3]


# ---- worker buffers (CPU, no engine) -------------------------------------------------------
SITES = (("pre_attn", 0), ("post_block", 0), ("post_block", 1))


def worker_state(tokens: int = 10) -> SteeringState:
    return SteeringState(SITES, 4, max_rows=4, max_tokens=32, max_slots=4,
                         device=torch.device("cpu"), capture_lanes=2, capture_tokens=tokens)


def test_worker_captures_prompt_rows_of_its_pass_and_frees_them():
    """Rows go to requests of the open pass only; collect returns x + h and frees them."""
    state = worker_state()
    state.capture.begin("t.0", ["post_block@1"])
    state.add_request("a-12345678", 1, {CAPTURE_KEY: "t.0:0"}, prompt_len=3)
    state.add_request("b", 2, {CAPTURE_KEY: "stale.0:1"}, prompt_len=2)
    state.add_request("c", 3, None, prompt_len=4)
    assert state.needs_fill and not state.any_steered
    state.fill(np.array([1, 2, 3]), np.zeros(3, np.int64),
               np.array([3, 2, 4]))
    assert state.token_rows.capture_rows[:9].tolist() == [1, 2, 3] + [0] * 6
    x, h = torch.randn(9, 4), torch.randn(9, 4)
    buffers = state.site_buffers()
    SiteOp(buffers[("post_block", 1)])(x, h)
    SiteOp(buffers[("post_block", 0)])(x, h)  # no lane: writes nothing
    reply = state.capture.collect(["t.0:0", "stale.0:1"], "all", reply=True)
    assert reply["sites"] == ["post_block@1"] and list(reply["missing"]) == ["stale.0:1"]
    data = np.frombuffer(reply["items"]["t.0:0"]["data"], "<f4")
    np.testing.assert_allclose(data.reshape(3, 4), (x + h)[:3].numpy(), rtol=1e-6)
    assert state.capture.rows_in_use == 0 and not state.needs_fill


def test_worker_reports_uncomputed_positions():
    """A prompt whose first positions were not computed (a prefix-cache hit) is refused."""
    state = worker_state()
    state.capture.begin("t.0", ["pre_attn@0"])
    state.add_request("a", 1, {CAPTURE_KEY: "t.0:0"}, prompt_len=5)
    state.fill(np.array([1]), np.array([2]), np.array([3]))
    reply = state.capture.collect(["t.0:0"], "last", reply=True)
    assert "positions 2..5 of 5" in reply["missing"]["t.0:0"]


def test_worker_rows_are_first_fit_and_bounded():
    state = worker_state(tokens=10)
    state.capture.begin("t.0", ["pre_attn@0"])
    for i, n in enumerate([4, 4, 3]):
        state.add_request(f"r{i}", i + 1, {CAPTURE_KEY: f"t.0:{i}"}, prompt_len=n)
    starts, rows = state.capture.slot_starts(np.array([1, 2, 3]))
    # The third does not fit in 10 rows.
    assert starts.tolist() == [1, 5, 0] and rows.tolist() == [4, 4, 0]
    state.capture.collect(["t.0:0"], "last", reply=False)
    state.add_request("r3", 3, {CAPTURE_KEY: "t.0:3"}, prompt_len=4)
    assert state.capture.slot_starts(np.array([3]))[0].tolist() == [1]


def test_superseded_pass_fails_cleanly_and_cannot_end_its_successor():
    """A second frontend's pass takes over: the first one's rows are gone (collect says so),
    and its late end leaves the second pass open."""
    state = worker_state()
    state.capture.begin("a.0", ["pre_attn@0"])
    state.add_request("x", 1, {CAPTURE_KEY: "a.0:0"}, prompt_len=2)
    state.capture.begin("b.0", ["post_block@0"])
    state.add_request("y", 2, {CAPTURE_KEY: "b.0:0"}, prompt_len=2)
    assert "no capture rows" in state.capture.collect(["a.0:0"], "last", True)["missing"]["a.0:0"]
    state.capture.end("a.0")
    assert state.capture.ticket == "b.0" and state.capture.rows_in_use == 2
    assert state.capture.site_lane.tolist() == [-1, 0, -1]


def test_worker_rejects_unmonitored_sites_and_too_many():
    state = worker_state()
    with pytest.raises(ValueError, match="'post_attn@0' is not a monitor site"):
        state.capture.begin("t.0", ["post_attn@0"])
    fused = SteeringState(SITES, 4, max_rows=4, max_tokens=32, max_slots=4,
                          device=torch.device("cpu"), capture_lanes=2, capture_tokens=8,
                          monitor_sites=frozenset({SITES[0]}))
    with pytest.raises(ValueError, match=r"is not a monitor site; add it to the engine option "
                                         r"dynsteer\.monitor_sites"):
        fused.capture.begin("t.0", [site_name(SITES[1])])
    with pytest.raises(ValueError, match="3 sites in one capture pass, expected 1 to 2"):
        state.capture.begin("t.0", ["pre_attn@0", "post_block@0", "post_block@1"])


# ---- real engines vs HF ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_streams(tiny_model_dir):
    """HF reference streams of PROMPTS, per architecture."""
    cache = {}

    def get(arch):
        if arch not in cache:
            hf = load_hf(tiny_model_dir(arch))
            cache[arch] = (hf, [record_streams(hf, p) for p in PROMPTS])
        return cache[arch]

    return get


def test_hook_reference_agrees_with_output_hidden_states(hf_streams):
    """pre_attn@l is hidden_states[l] and post_block@l is hidden_states[l + 1] (the last entry
    is after the final norm, so it is not compared)."""
    hf, streams = hf_streams("llama")
    with torch.no_grad():
        hidden = hf(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states
    for layer in range(LAYERS):
        np.testing.assert_allclose(streams[1][("pre_attn", layer)], hidden[layer][0], atol=1e-5)
        if layer + 1 < LAYERS:
            np.testing.assert_allclose(streams[1][("post_block", layer)], hidden[layer + 1][0],
                                       atol=1e-5)


# Tiny Llama behind AsyncLLM: 12 sites / 4 lanes = 3 passes; 77 tokens / 32 = 3 rounds.
@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def async_engine(loop, tiny_model_dir):
    engine = loop.run_until_complete(start_async_llm(
        tiny_model_dir("llama"),
        dynsteer={"sites": ALL_SITES, "monitor_sites": ALL_SITES, "capture_lanes": 4,
                  "capture_tokens": 32}))
    yield engine
    stop_async_llm(engine)
    loop.run_until_complete(asyncio.sleep(0.1))


@pytest.mark.engine
@pytest.mark.parametrize("reduce", ["last", "mean", "all"])
def test_async_capture_matches_hf(loop, async_engine, hf_streams, reduce):
    """Every site, every prompt: the engine's capture equals HF's stream, reduced."""
    result = loop.run_until_complete(capture_async(async_engine, PROMPTS, ALL_SITES, reduce))
    assert len(result) == 3 * LAYERS
    assert_capture_matches_hf(result, hf_streams("llama")[1], reduce)


@pytest.mark.engine
def test_a_cancelled_capture_frees_the_engine_for_the_next(loop, async_engine, hf_streams):
    """Cancelling a capture mid-way (its HTTP client disconnected) aborts its requests and
    ends its pass: the next capture starts at once and is exact."""
    async def scenario():
        task = asyncio.ensure_future(capture_async(async_engine, PROMPTS * 30, ALL_SITES,
                                                   "mean"))
        await asyncio.sleep(0.5)
        assert not task.done(), "the capture to cancel finished already"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await asyncio.wait_for(capture_async(async_engine, PROMPTS, ALL_SITES, "last"),
                                      60)

    result = loop.run_until_complete(scenario())
    assert_capture_matches_hf(result, hf_streams("llama")[1], "last")


@pytest.mark.engine
def test_capture_alongside_steered_requests(loop, async_engine, hf_streams):
    """Steered requests batched with a capture are unchanged, and the capture stays exact."""
    engine = async_engine
    steer = {"steer": [{"vector": vec(5), "layers": [0, 2]},
                       {"vector": vec(6), "layers": [1], "hook": "post_attn"}]}
    gated = {"gate": {"probe": {"weights": vec(7, norm=1.0), "threshold": 0.0},
                      "layer": 1, "steer": [{"vector": vec(8), "layers": [2, 3]}]}}
    prompt_a, prompt_b = PROMPTS[3], PROMPTS[1]
    decode_a = 200

    async def final(prompt, sp, request_id, started=None):
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id):
            last = out
            if started is not None:
                started.set()
        return last

    async def scenario():
        solo_a = await final(prompt_a, params(decode_a, spec=steer), "solo-a")
        solo_b = await final(prompt_b, params(8, spec=gated), "solo-b")
        started = asyncio.Event()
        task_a = asyncio.ensure_future(final(prompt_a, params(decode_a, spec=steer), "a",
                                             started))
        await started.wait()  # a is decoding while the capture's prompts prefill
        task_b = asyncio.ensure_future(final(prompt_b, params(8, spec=gated), "b"))
        captured = await capture_async(engine, PROMPTS, "post_attn@1,post_block@2", "all")
        a_outlived_capture = not task_a.done()
        return solo_a, solo_b, await task_a, await task_b, captured, a_outlived_capture

    solo_a, solo_b, out_a, out_b, captured, overlapped = loop.run_until_complete(scenario())
    assert overlapped, "the steered request should be decoding during the whole capture"
    for solo, out in ((solo_a, out_a), (solo_b, out_b)):
        assert_same_output(out, solo)
    assert_capture_matches_hf(captured, hf_streams("llama")[1], "all")
    info = loop.run_until_complete(engine.collective_rpc("dynsteer_info"))
    assert info[0]["capture_rows_in_use"] == 0


# Tiny Qwen3 behind the offline LLM: 5 sites / 2 lanes = 3 passes; 4 rounds of <= 24 tokens.
OFFLINE_SITES = "post_block@*,post_attn@1"


@pytest.fixture(scope="module")
def offline_llm(tiny_model_dir):
    llm = start_llm(tiny_model_dir("qwen3"), dynsteer={
        "sites": OFFLINE_SITES, "monitor_sites": OFFLINE_SITES, "capture_lanes": 2,
        "capture_tokens": 24})
    yield llm
    stop_llm(llm)


@pytest.mark.engine
@pytest.mark.parametrize("reduce", ["last", "mean", "all"])
def test_offline_capture_matches_hf(offline_llm, hf_streams, reduce):
    """``Steering.capture`` on the offline LLM equals HF's streams, reduced."""
    result = Steering(offline_llm).capture(PROMPTS, OFFLINE_SITES, reduce=reduce)
    assert set(result) == {"post_attn@1", *(f"post_block@{i}" for i in range(LAYERS))}
    assert_capture_matches_hf(result, hf_streams("qwen3")[1], reduce)


@pytest.mark.engine
def test_capture_reads_the_stream_before_each_sites_steering(offline_llm, hf_streams):
    """Under global steering, a site's capture excludes that site's own vector and includes
    every earlier site's (the value the monitor reads)."""
    entries = [{"vector": vec(21), "layers": [1, 2]}]
    steering = Steering(offline_llm)
    steering.set_global(entries)
    try:
        result = steering.capture(PROMPTS[:3], "post_block@0-2", reduce="all")
    finally:
        steering.clear_global()
    hf = hf_streams("qwen3")[0]
    want = [record_streams(hf, p, entries) for p in PROMPTS[:3]]
    assert_capture_matches_hf(result, want, "all")
    unsteered = hf_streams("qwen3")[1]
    earlier = np.abs(result["post_block@2"][0] - unsteered[0][("post_block", 2)]).max()
    assert earlier > 100 * CAPTURE_ATOL, "steering at layer 1 must show at post_block@2"
    own = np.abs(result["post_block@1"][0] - unsteered[0][("post_block", 1)]).max()
    assert own < CAPTURE_ATOL, "post_block@1 is captured before its own vector is added"


@pytest.mark.engine
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sites": "post_attn@2"}, "post_attn@2 is not a monitor site"),
    ({"prompts": [[1] * 25]}, r"raise dynsteer.capture_tokens"),
    ({"reduce": "median"}, r"^reduce: "),
    ({"prompts": [[1, 2], "hello"]}, r"prompts\[1\]: a text prompt needs the engine's "
                                     "tokenizer"),
])
def test_engine_errors_are_value_errors(offline_llm, kwargs, message):
    args = {"prompts": PROMPTS[:2], "sites": "post_block@1", "reduce": "last", **kwargs}
    with pytest.raises(ValueError, match=message):
        Steering(offline_llm).capture(**args)


@pytest.mark.engine
def test_forged_capture_key_runs_uncaptured(offline_llm):
    """A request carrying a capture key outside a capture is served normally."""
    forged = params(6)
    forged.extra_args = {CAPTURE_KEY: "guess.0:0"}
    plain, out = run(offline_llm, [PROMPTS[2]] * 2, [params(6), forged])
    assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert all(i["capture_rows_in_use"] == 0 for i in Steering(offline_llm).info())


@pytest.mark.engine
@pytest.mark.tp2
def test_tp2_capture_matches_hf_and_only_rank0_replies(tiny_model_dir, hf_streams, monkeypatch):
    """Under TP=2 the capture equals HF's, and only TP rank 0 sends rows back."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    llm = start_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                    dynsteer={"sites": "post_attn@1,post_block@*",
                              "monitor_sites": "post_attn@1,post_block@*", "capture_tokens": 48})
    try:
        result = Steering(llm).capture(PROMPTS, "post_attn@1,post_block@3", reduce="mean")
        llm.collective_rpc("dynsteer_capture_begin", args=("probe.0", ["post_block@0"]))
        replies = llm.collective_rpc("dynsteer_capture_collect", args=(["probe.0:0"], "last"))
        llm.collective_rpc("dynsteer_capture_end", args=("probe.0",))
    finally:
        stop_llm(llm)
    assert_capture_matches_hf(result, hf_streams("llama")[1], "mean")
    assert replies[0] is not None and replies[1] is None

