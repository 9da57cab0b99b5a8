"""Activation capture for probe training: the planner, the whole path on a real worker state,
and real engines vs HF.

Engine tests: a tiny Llama behind ``AsyncLLM`` (the API server's client, ``capture_async``) and a
tiny Qwen3 behind the offline ``LLM`` (``Steering.capture``), both compiled, fp32. Small
``capture_lanes`` / ``capture_tokens`` make every capture take several passes and rounds.
"""

from __future__ import annotations

import asyncio
import os
import time
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

from dynsteer.controller.extra_args import ACTIVATIONS_KEY, SPEC_KEY
from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.frontend import capture as capture_module
from dynsteer.engine_ext.frontend import rows_inbox
from dynsteer.engine_ext.frontend.capture import (
    STALLS,
    _drive,
    _Free,
    _protocol,
    _Round,
    _Wait,
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


def fake_frontend(sites: str = "post_block@*,post_attn@1", lanes: int = 2, tokens: int = 24,
                  max_bytes: int = 128 << 20):
    options = EngineOptions(sites=sites, monitor_sites=sites, capture_lanes=lanes,
                            capture_tokens=tokens, capture_max_bytes=max_bytes)
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
    assert p.rounds(list(range(len(PROMPTS)))) == [[0, 1, 2], [3, 4], [5], [6]]
    assert p.rounds([4, 6, 0]) == [[4], [6], [0]]
    assert p.passes == [["post_block@0", "post_attn@1"], ["post_block@1", "post_block@2"],
                        ["post_block@3"]]


@pytest.mark.parametrize(("reduce", "positions"), [("last", "last_prompt"), ("mean", "prompt"),
                                                   ("all", "prompt")])
def test_plan_items_are_prefill_only_requests_capturing_their_prompt(reduce, positions):
    """Each item generates one token and its spec captures the pass's sites at the positions
    its reduction needs; request ids are unique per capture, pass and attempt."""
    p = plan(reduce=reduce)
    items = p.items(1, [0, 3], attempt=2)
    assert [it.index for it in items] == [0, 3]
    assert all(it.params.max_tokens == 1 for it in items)
    assert items[0].params.extra_args == {SPEC_KEY: {"capture": {
        "sites": ["post_block@1", "post_block@2"], "positions": positions,
        **({"reduce": "mean"} if reduce == "mean" else {})}}}
    ids = {it.request_id for a in range(3) for it in p.items(1, [0, 3], a)}
    assert len(ids) == 6 and not ids & {it.request_id for it in plan().items(1, [0, 3], 2)}


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
    ({"reduce": "all", "max_bytes": 77 * 5 * HIDDEN * 4 - 1},
     rf"^prompts: the capture returns {77 * 5 * HIDDEN * 4} bytes \(77 rows x 5 sites x "
     rf"{HIDDEN} float32\); this engine returns at most {77 * 5 * HIDDEN * 4 - 1} per capture "
     r"\(dynsteer.capture_max_bytes\)"),
    ({"reduce": "last", "max_bytes": 7 * 5 * HIDDEN * 4 - 1}, r"^prompts: .* \(7 rows x 5"),
])
def test_bad_arguments_raise_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_a_capture_of_exactly_the_byte_cap_is_planned():
    assert plan(reduce="all", max_bytes=77 * 5 * HIDDEN * 4).reduce == "all"


def test_a_failed_round_frees_its_rows_then_fails():
    """An engine call failing mid-capture frees the round's rows, then the error propagates."""
    calls = []

    def execute(step):
        calls.append(step)
        if isinstance(step, _Round):
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        _drive(_protocol(plan()), execute)
    assert [type(c) for c in calls] == [_Round, _Free]
    assert calls[0].items == calls[1].items


class FakeLLM:
    """An offline-LLM stand-in whose "forward" writes stream = token id + 1000 * layer into a
    real worker state, so the whole path (passes, rounds, admission of the capture spec,
    collection, assembly) runs without vLLM engines; its tokenizer maps each character to its
    code point. ``interloper``: after each of the first that many rounds, another request
    capturing every row of the buffer is admitted, which takes the finished rows."""

    def __init__(self, sites: str, lanes: int, tokens: int, interloper: int = 0) -> None:
        self.frontend = fake_frontend(sites, lanes, tokens)
        self.state = SteeringState(self.frontend.sites, HIDDEN, max_rows=4, max_tokens=256,
                                   max_slots=64, device=torch.device("cpu"),
                                   capture_lanes=lanes, capture_tokens=tokens)
        self.interloper = interloper
        self.rounds = 0

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [ord(ch) for ch in text])

    def collective_rpc(self, method, args=()):
        assert method == "dynsteer_collect_activations"
        requests, _, _ = args
        return [self.state.collect_activations([tuple(r) for r in requests], True, None)]

    def generate(self, prompts, params, use_tqdm=False):
        tokens = [p["prompt_token_ids"] for p in prompts]
        ids = [f"r{self.rounds}.{i}" for i in range(len(prompts))]
        for i, (req, sp) in enumerate(zip(ids, params, strict=True)):
            spec = sp.extra_args[SPEC_KEY]["capture"]  # what admission writes for the workers
            self.state.add_request(req, i + 1, {ACTIVATIONS_KEY: {
                "sites": spec["sites"], "rows": len(tokens[i]), "positions": spec["positions"],
                "dtype": "float32", "reduce": spec.get("reduce")}}, len(tokens[i]))
        lens = np.array([len(t) for t in tokens])
        self.state.fill(np.arange(1, len(ids) + 1), np.zeros(len(ids), np.int64), lens)
        flat = torch.tensor([t for p in tokens for t in p], dtype=torch.float32)
        for (_, layer), buffers in self.state.site_buffers().items():
            x = (flat + 1000 * layer)[:, None].expand(-1, HIDDEN).contiguous()
            SiteOp(buffers)(x, torch.zeros_like(x))
        for req in ids:
            self.state.remove_request(req)
        self.rounds += 1
        if self.rounds <= self.interloper:
            other = f"other{self.rounds}"
            self.state.add_request(other, 60, {ACTIVATIONS_KEY: {
                "sites": ["post_block@0"], "rows": self.frontend.options.capture_tokens,
                "positions": "all", "dtype": "float32"}}, 1)
            self.state.remove_request(other)
            self.state.collect_activations([(other, None, 0)], False, None)
        return [SimpleNamespace(request_id=req, prompt_token_ids=t,
                                outputs=[SimpleNamespace(token_ids=[0])])
                for req, t in zip(ids, tokens, strict=True)]


def captured(llm, prompts, sites, reduce, monkeypatch):
    monkeypatch.setattr(capture_module, "_frontend", lambda engine: engine.frontend)
    monkeypatch.setattr(capture_module.time, "sleep", lambda seconds: None)
    return capture_module.capture_sync(llm, prompts, sites, reduce)


def test_capture_end_to_end_with_text_prompts(monkeypatch):
    """Texts are tokenized; every pass and round lands in the right prompt and site, and
    every row is freed."""
    llm = FakeLLM("post_block@*,post_attn@1", lanes=2, tokens=6)
    prompts = ["abc", [7, 8, 9, 10], "hello", [5]]
    out = captured(llm, prompts, "post_block@*,post_attn@1", "all", monkeypatch)
    assert set(out) == {"post_attn@1", *(f"post_block@{i}" for i in range(LAYERS))}
    for site, arrays in out.items():
        layer = int(site.split("@")[1])
        for prompt, got in zip(prompts, arrays, strict=True):
            ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
            np.testing.assert_array_equal(got[:, 0], np.array(ids) + 1000 * layer)
    means = captured(llm, prompts, "post_block@2", "mean", monkeypatch)["post_block@2"]
    np.testing.assert_allclose(means[:, 0], [98 + 2000, 8.5 + 2000, 106.4 + 2000, 5 + 2000])
    lasts = captured(llm, prompts, "post_block@2", "last", monkeypatch)["post_block@2"]
    np.testing.assert_array_equal(lasts[:, 0], [99 + 2000, 10 + 2000, 111 + 2000, 5 + 2000])
    assert llm.state.capture.rows_in_use == 0
    assert llm.state.capture.site_lane.tolist() == [-1] * len(llm.frontend.sites)


def test_prompts_whose_rows_were_taken_run_again(monkeypatch):
    """Another request takes the finished rows before they are collected (``dropped``): those
    prompts run again, and the result is the same as undisturbed."""
    prompts = [[7, 8, 9], [1, 2], [3, 4, 5, 6]]
    calm = captured(FakeLLM("post_block@*", 2, 6), prompts, "post_block@1", "all", monkeypatch)
    busy = FakeLLM("post_block@*", 2, 6, interloper=3)
    out = captured(busy, prompts, "post_block@1", "all", monkeypatch)
    assert busy.rounds > 3
    for want, got in zip(calm["post_block@1"], out["post_block@1"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_capture_whose_rows_are_always_taken_fails_naming_the_options(monkeypatch):
    llm = FakeLLM("post_block@*", 2, 6, interloper=10 * STALLS)
    with pytest.raises(RuntimeError, match=r"prompts\[0\]: other capturing requests held the "
                                           rf"engine's capture rows or lanes {STALLS} times"):
        captured(llm, [[1, 2, 3]], "post_block@1", "last", monkeypatch)
    assert llm.rounds == STALLS


def test_waits_grow_while_no_prompt_gets_through():
    """Between attempts the protocol waits, doubling while nothing gets through and starting
    over once something does."""
    from dynsteer.controller.activations import Activations

    p = plan(prompts=[[1, 2], [3, 4]], sites="post_block@0", reduce="last")
    ok = Activations("ok", np.array([1]), {"post_block@0": np.ones((1, HIDDEN), np.float32)},
                     "float32")
    dropped = Activations("dropped", np.array([], np.int64), {}, "float32", "taken")
    answers = iter([[dropped, dropped], [dropped, dropped], [ok, dropped], [ok]])
    waits = []

    def execute(step):
        if isinstance(step, _Wait):
            waits.append(step.seconds)
            return None
        return next(answers)

    out = _drive(_protocol(p), execute)
    assert out["post_block@0"].shape == (2, HIDDEN)
    assert waits == [2 * capture_module.BACKOFF_S, 4 * capture_module.BACKOFF_S,
                     capture_module.BACKOFF_S]


def test_encode_result_is_json_with_dtype_and_shape():
    result = {"post_block@0": np.ones((2, 3), np.float32),
              "post_block@1": [np.zeros((4, 3), np.float32)]}
    out = encode_result(result)
    assert out["post_block@0"]["shape"] == [2, 3] and out["post_block@0"]["dtype"] == "float32"
    assert out["post_block@1"][0]["shape"] == [4, 3]


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
    frees their rows: the next capture is exact, and no row (nor reply file) is left held."""
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
    info = loop.run_until_complete(async_engine.collective_rpc("dynsteer_info"))
    assert info[0]["capture_rows_in_use"] == 0
    assert os.listdir(rows_inbox.inbox()["folder"]) == ["token"], "a cancelled reply's file"


@pytest.mark.engine
def test_a_large_capture_does_not_starve_other_requests(loop, async_engine):
    """A plain request sent while a capture of many prompts runs is batched with the
    capture's requests (they are ordinary requests to vLLM's scheduler): it comes back while
    the capture still has most of its work ahead."""
    async def plain(request_id):
        async for out in async_engine.generate({"prompt_token_ids": PROMPTS[0]}, params(4),
                                               request_id):
            last = out
        return last

    async def scenario():
        await plain("plain-alone")  # the engine warmed up
        big = asyncio.ensure_future(capture_async(async_engine, PROMPTS * 10, ALL_SITES, "mean"))
        await asyncio.sleep(0.3)
        start = time.monotonic()
        last = await plain("plain-beside-a-capture")
        took = time.monotonic() - start
        assert not big.done(), "the capture finished before the plain request"
        await big
        return last, took, time.monotonic() - start

    last, took, total = loop.run_until_complete(scenario())
    assert len(last.outputs[0].token_ids) == 4
    assert took < total / 3, (took, total)


@pytest.mark.engine
def test_concurrent_captures_are_each_exact(loop, async_engine, hf_streams):
    """Two captures at once, of different sites and reductions, on an engine whose lanes
    and rows hold only one of them at a time: both are exact, and every row is freed."""
    async def scenario():
        return await asyncio.gather(
            capture_async(async_engine, PROMPTS, ALL_SITES, "all"),
            capture_async(async_engine, PROMPTS[::-1], "post_attn@0-3", "mean"))

    every, means = loop.run_until_complete(scenario())
    assert_capture_matches_hf(every, hf_streams("llama")[1], "all")
    assert_capture_matches_hf(means, hf_streams("llama")[1][::-1], "mean")
    info = loop.run_until_complete(async_engine.collective_rpc("dynsteer_info"))
    assert info[0]["capture_rows_in_use"] == 0


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
@pytest.mark.tp2
def test_tp2_capture_matches_hf_and_only_rank0_replies(tiny_model_dir, hf_streams, monkeypatch):
    """Under TP=2 the capture equals HF's, and only TP rank 0 sends rows back."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    llm = start_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                    dynsteer={"sites": "post_attn@1,post_block@*",
                              "monitor_sites": "post_attn@1,post_block@*", "capture_tokens": 48})
    try:
        result = Steering(llm).capture(PROMPTS, "post_attn@1,post_block@3", reduce="mean")
        out = run(llm, [PROMPTS[0]], [params(2, spec={"capture": {"sites": "post_block@0"}})])
        replies = llm.collective_rpc("dynsteer_collect_activations",
                                     args=([[out[0].request_id, None, 0]], None))
    finally:
        stop_llm(llm)
    assert_capture_matches_hf(result, hf_streams("llama")[1], "mean")
    assert replies[0] is not None and replies[1] is None

