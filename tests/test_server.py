"""`dynsteer serve` end to end: a real CPU vLLM server on loopback, the openai client, our routes.

One server and one offline engine (the reference) are shared by the module; both use the same
tiny Llama with the embedded model's tokenizer, greedy decoding and seed 0.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch
from engine_utils import start_llm, stop_llm
from server_utils import Server, http

from dynsteer import capture
from dynsteer.controller.client import DynsteerClient, DynsteerHTTPError
from dynsteer.controller.contract import encode_f32
from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.server.sessions import key_namespace

pytestmark = pytest.mark.engine

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
MAX_TOKENS = 8
RNG = np.random.default_rng(7)
VECTOR = (RNG.standard_normal(128) * 4).tolist()
STATIC = {"steer": [{"vector": VECTOR, "layers": [1, 2]}]}
GATED = {"gate": {"probe": {"weights": VECTOR, "threshold": 0.0}, "layer": 1, "trace": True,
                  "steer": [{"vector": VECTOR, "layers": [2], "scale": 2.0}]}}


@pytest.fixture(scope="module")
def sink_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("audit")


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory, sink_dir):
    srv = Server(chat_model, tmp_path_factory.mktemp("server") / "serve.log",
                 "--dynsteer-api-key", KEY, "--dynsteer-max-body-bytes", "65536",
                 "--dynsteer-capture-sinks", f"audit={sink_dir}?seal_after_s=0.5", inductor=True)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(chat_model, server):
    """The reference: the same model in an offline ``LLM`` (started while the server boots)."""
    llm = start_llm(chat_model, dynsteer={}, skip_tokenizer_init=False, max_num_seqs=8)
    server.wait_ready()
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="module")
def openai_client(server, offline):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server, offline):
    return DynsteerClient(server.url, api_key=KEY)


def chat(openai_client, stream: bool = False, **extra):
    model = openai_client.models.list().data[0].id
    response = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
        stream=stream, **({"extra_body": extra} if extra else {}))
    if stream:
        chunks = list(response)
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks
                                     if c.choices)
    return response.id, response.choices[0].message.content


def offline_chat(llm, spec=None):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
                        extra_args={"dynsteer": spec} if spec is not None else None)
    out = llm.chat([MESSAGES], sp, use_tqdm=False)[0]
    return out.outputs[0].text, out


def test_openapi_lists_the_routes(server, offline):
    status, schema = http("GET", server.url + "/openapi.json")
    assert status == 200
    paths = set(schema["paths"])
    for path in ("/v1/dynsteer/health", "/v1/dynsteer/info", "/v1/dynsteer/global",
                 "/v1/dynsteer/vectors", "/v1/dynsteer/vectors/{name}",
                 "/v1/dynsteer/requests/{request_id}"):
        assert path in paths, path
    assert "VectorIn" in schema["components"]["schemas"]
    assert set(schema["paths"]["/v1/dynsteer/global"]) >= {"get", "put", "delete"}


def test_info_describes_the_model(client):
    info = client.info()
    assert (info.hidden_size, info.num_layers) == (128, 4)
    assert info.sites == [f"post_block@{i}" for i in range(4)]
    assert info.vllm_version and info.plugin_version


def test_steered_chat_both_ways_equals_offline(openai_client, offline):
    _, plain = chat(openai_client)
    _, via_xargs = chat(openai_client, vllm_xargs={"dynsteer": json.dumps(STATIC)})
    _, via_body = chat(openai_client, dynsteer=STATIC)
    assert via_xargs == via_body
    assert via_body != plain
    assert offline_chat(offline, STATIC)[0] == via_body
    assert offline_chat(offline)[0] == plain


def test_completions_route_takes_the_spec(openai_client, server):
    model = openai_client.models.list().data[0].id

    def complete(**extra):
        r = openai_client.completions.create(model=model, prompt="The sea is", max_tokens=6,
                                             temperature=0.0, extra_body=extra or None)
        return r.choices[0].text

    assert complete(dynsteer=STATIC) == complete(vllm_xargs={"dynsteer": json.dumps(STATIC)})
    assert complete(dynsteer=STATIC) != complete()


CAPTURE = {**STATIC, "capture": {"sites": ["post_block@1", "post_block@2"], "dtype": "float16"}}


def test_activations_come_back_in_the_response(openai_client, offline):
    """A chat and a two-prompt completion with ``capture``: each choice's activations are in
    the JSON, equal to the offline engine's for the same request, and read back by
    ``activations_of`` from the openai client's response."""
    from dynsteer.controller.activations import activations_of

    model = openai_client.models.list().data[0].id
    response = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, seed=0,
        extra_body={"dynsteer": CAPTURE})
    (acts,) = activations_of(response)
    computed = response.usage.prompt_tokens + MAX_TOKENS - 1
    assert acts.status == "ok" and acts.positions.tolist() == list(range(computed))
    _, out = offline_chat(offline, CAPTURE)
    want = Steering(offline).activations(out)
    for site in ("post_block@1", "post_block@2"):
        assert acts[site].dtype == np.float16 and acts[site].shape == (computed, 128)
        np.testing.assert_allclose(acts[site], want[site], atol=2e-3, rtol=2e-3)
    completion = openai_client.completions.create(
        model=model, prompt=["The sea is", "Bread needs"], max_tokens=4, temperature=0.0,
        extra_body={"dynsteer": {"capture": {"sites": "post_block@1",
                                             "positions": "last_prompt"}}})
    found = activations_of(completion)
    assert [a.status for a in found] == ["ok", "ok"]
    assert all(a["post_block@1"].shape == (1, 128) for a in found)
    assert not np.array_equal(found[0]["post_block@1"], found[1]["post_block@1"])
    assert activations_of(openai_client.completions.create(
        model=model, prompt="The sea is", max_tokens=2)) == [None]


def test_a_client_that_accepts_gzip_gets_the_activations_compressed(openai_client):
    """With ``Accept-Encoding: gzip`` (as the ``openai`` client sends), a response carrying
    activations comes gzip-compressed; without it, as it is. The same JSON either way."""
    import gzip
    import urllib.request

    from dynsteer import activations_of

    model = openai_client.models.list().data[0].id
    body = json.dumps({"model": model, "prompt": "The sea is", "max_tokens": 3,
                       "temperature": 0.0, "dynsteer": {"capture": {"sites": "post_block@1"}}})

    def post(accept):
        request = urllib.request.Request(openai_client.base_url.join("completions").__str__(),
                                         data=body.encode(), method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header("Authorization", f"Bearer {KEY}")
        if accept:
            request.add_header("Accept-Encoding", accept)
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.headers.get("Content-Encoding"), r.read()

    encoding, packed = post("gzip, deflate")
    plain_encoding, plain = post(None)
    assert encoding == "gzip" and plain_encoding is None
    packed_json, plain_json = json.loads(gzip.decompress(packed)), json.loads(plain)
    (a,), (b,) = activations_of(packed_json), activations_of(plain_json)
    assert a.status == b.status == "ok"
    np.testing.assert_array_equal(a["post_block@1"], b["post_block@1"])


def test_each_of_n_completions_gets_its_own_activations(openai_client, client):
    """``n = 2`` completions of each of two prompts: choice ``i`` is completion ``i % 2`` of
    prompt ``i // 2``, each with its own rows: the same prompt rows as its sibling's, its own
    generated ones; the chat route likewise."""
    from dynsteer import activations_of

    model = openai_client.models.list().data[0].id
    spec = {"capture": {"sites": "post_block@1"}}
    prompts = ["The sea is", "Bread needs a hot"]
    completion = openai_client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=3,
        extra_body={"dynsteer": spec, "ignore_eos": True})
    found = activations_of(completion)
    assert [a.status for a in found] == ["ok"] * 4
    by_index = {c.index: c for c in completion.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    for prompt in (0, 1):
        first, second = found[2 * prompt], found[2 * prompt + 1]
        assert len(first.positions) == len(second.positions) > 4
        rows = len(first.positions) - 4  # the prompt's
        np.testing.assert_allclose(first["post_block@1"][:rows], second["post_block@1"][:rows],
                                   atol=1e-5)
        if by_index[2 * prompt].text != by_index[2 * prompt + 1].text:
            assert not np.array_equal(first["post_block@1"][rows:],
                                      second["post_block@1"][rows:])
    assert len(found[0].positions) != len(found[2].positions)
    chat, found = client.complete({"model": model, "messages": MESSAGES, "n": 2,
                                   "max_tokens": 4, "temperature": 1.0, "seed": 3,
                                   "ignore_eos": True, "dynsteer": spec})
    assert len(chat["choices"]) == 2 and [a.status for a in found] == ["ok", "ok"]
    assert all(len(a.positions) == chat["usage"]["prompt_tokens"] + 3 for a in found)


def sealed(sink_dir, count, timeout=30.0):
    """The sink's folder once its index names ``count`` requests."""
    deadline = time.monotonic() + timeout
    while True:
        store = capture.open(sink_dir)
        if len(store) >= count or time.monotonic() > deadline:
            return store
        time.sleep(0.2)


def test_a_capture_into_a_sink_and_the_global_capture(openai_client, server, sink_dir):
    """A request's capture naming a sink lands there (the response keeps status and
    positions); the global capture adds one to every completion that has none,
    until deleted; the sink's counters are in /metrics."""
    model = openai_client.models.list().data[0].id
    spec = {"capture": {"sites": "post_block@2", "positions": "generated", "sink": "audit"}}
    response = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"dynsteer": spec})
    item = response.model_extra["dynsteer"]["activations"][0]
    assert item["sink"] == "audit" and item["sites"] == {} and len(item["positions"]) == 7
    store = sealed(sink_dir, 1)
    (first,) = list(store)
    assert first.request_id.startswith(response.id) and first["post_block@2"].shape == (7, 128)
    assert first.meta["caller"] == key_namespace(KEY), "the sink records whose request it was"
    headers = {"api_key": KEY}
    everything = {"sites": "post_block@1", "positions": "last_prompt", "sink": "audit",
                  "dtype": "bfloat16"}
    assert http("PUT", server.url + "/v1/dynsteer/capture/global", everything,
                **headers)[0] == 200
    try:
        plain = openai_client.completions.create(model=model, prompt="The sea is",
                                                 max_tokens=3, temperature=0.0)
        streamed = list(openai_client.completions.create(
            model=model, prompt="The sea is", max_tokens=3, stream=True))
    finally:
        assert http("DELETE", server.url + "/v1/dynsteer/capture/global", **headers)[0] == 200
    assert plain.model_extra["dynsteer"]["activations"][0]["sink"] == "audit"
    assert streamed[-1].model_extra["dynsteer"]["activations"][0]["sink"] == "audit"
    store = sealed(sink_dir, 3)
    assert len(store) == 3 and store.site("post_block@1").shape == (2, 128)
    after = openai_client.completions.create(model=model, prompt="The sea is", max_tokens=3)
    assert "dynsteer" not in (after.model_extra or {})
    status, text = http("GET", server.url + "/metrics")
    assert re.search(r'dynsteer_capture_sink_requests_total\{sink="audit"\} 3\.0', text)
    status, body = http("PUT", server.url + "/v1/dynsteer/capture/global",
                        {"sites": "post_block@1"}, **headers)
    assert status == 400 and "a global capture needs a sink" in body["error"]["message"]
    bad = {"capture": {"sites": "post_block@1", "sink": "elsewhere"}}
    with pytest.raises(Exception, match=r"dynsteer\.capture\.sink: 'elsewhere' is not a "
                                        r"capture sink here \(configured: audit"):
        chat(openai_client, dynsteer=bad)



def test_a_global_capture_scoped_to_a_session_or_a_key(openai_client, client, server,
                                                       sink_dir):
    """Scoped to a session, the global capture covers that session's completions only (the
    name as the server namespaces it); scoped to a key's namespace, only that key's."""
    model = openai_client.models.list().data[0].id
    before = len(capture.open(sink_dir))
    everything = {"sites": "post_block@1", "positions": "last_prompt", "sink": "audit"}
    audited = key_namespace(KEY) + "audited"

    def complete(session=None, api_key=KEY):
        body = {"model": model, "prompt": "The sea is", "max_tokens": 2, "temperature": 0.0}
        if session is not None:
            body["dynsteer"] = {"session": session}
        status, found = http("POST", server.url + "/v1/completions", body, api_key=api_key)
        assert status == 200, found
        return (found.get("dynsteer") or {}).get("activations")

    scoped = client.set_global_capture(everything, session=audited)
    try:
        assert (scoped.session, scoped.caller) == (audited, None)
        assert client.get_global_capture().session == audited
        assert complete("audited")[0]["sink"] == "audit"
        assert complete("other") is None and complete() is None
        assert complete("audited", api_key=None) is None  # another namespace's "audited"
        client.set_global_capture(everything, caller=key_namespace(KEY))
        assert complete()[0]["sink"] == "audit"
        assert complete(api_key=None) is None
    finally:
        client.clear_global_capture()
    assert client.get_global_capture().session is None
    assert len(sealed(sink_dir, before + 2)) == before + 2
    status, body = http("PUT", server.url + "/v1/dynsteer/capture/global?caller=nobody",
                        everything, api_key=KEY)
    assert status == 400 and "caller" in json.dumps(body)

def test_a_streamed_request_gets_its_rows_as_they_are_computed(openai_client):
    """The stream passes through as it comes; its rows come in events between its chunks,
    each with the positions computed since the last, and in one before ``[DONE]`` with the
    rest. Joined, they are the rows the same request gets unstreamed (the stream's may hold
    one more position: its token counts are not known)."""
    from dynsteer.controller.activations import activations_of, activations_of_stream

    model = openai_client.models.list().data[0].id
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 64, "temperature": 0.0,
              "seed": 0, "extra_body": {"dynsteer": CAPTURE, "ignore_eos": True}}
    whole = activations_of(openai_client.chat.completions.create(**kwargs))[0]
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    events = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("dynsteer")]
    assert events[-1] == len(chunks) - 1 and not chunks[-1].choices
    assert len(events) >= 3 and events[0] < max(i for i, c in enumerate(chunks) if c.choices)
    streamed = activations_of_stream(chunks)[0]
    assert streamed.status == "ok" and np.all(np.diff(streamed.positions) == 1)
    n = len(whole.positions)
    assert streamed.positions[:n].tolist() == whole.positions.tolist()
    assert len(streamed.positions) - n in (0, 1)
    for site in whole.sites:
        np.testing.assert_allclose(streamed[site][:n].astype(np.float32),
                                   whole[site].astype(np.float32), atol=2e-3, rtol=2e-3)


def test_global_steering_changes_outputs_and_returns_to_baseline(openai_client, client):
    _, before = chat(openai_client)
    _, as_spec = chat(openai_client, dynsteer=STATIC)
    state = client.set_global(STATIC["steer"])
    assert len(state.steer) == 1 and client.get_global().steer[0].layers == [1, 2]
    _, steered = chat(openai_client)
    client.clear_global()
    _, after = chat(openai_client)
    assert steered != before and steered == as_spec
    assert after == before
    assert client.get_global().steer == []


def test_named_vector_round_trip(openai_client, client):
    client.register_vector("sea", VECTOR)
    with pytest.raises(DynsteerHTTPError) as taken:
        client.register_vector("sea", VECTOR)
    assert taken.value.status == 409 and "replace" in taken.value.message
    client.register_vector("sea", VECTOR, replace=True)
    assert "sea" in client.vectors()
    np.testing.assert_allclose(client.get_vector("sea"), np.float32(VECTOR), rtol=0, atol=0)
    by_name = {"steer": [{"vector": "sea", "layers": [1, 2]}]}
    inline = {"steer": [{"vector": np.float32(VECTOR).tolist(), "layers": [1, 2]}]}
    assert chat(openai_client, dynsteer=by_name)[1] == chat(openai_client, dynsteer=inline)[1]
    client.delete_vector("sea")
    with pytest.raises(Exception, match=r"dynsteer\.steer\[0\]\.vector"):
        chat(openai_client, dynsteer=by_name)


def test_gated_request_telemetry_matches_offline(openai_client, client, offline):
    from dynsteer.engine_ext import Steering

    request_id, text = chat(openai_client, dynsteer=GATED)
    report = client.request(request_id)
    assert report.gated and not report.static
    expected_text, out = offline_chat(offline, GATED)
    expected = Steering(offline).telemetry(out)
    assert text == expected_text
    got = report.telemetry
    assert got.tokens_monitored == expected["tokens_monitored"] > 0
    assert got.gated_prefill == expected["gated_prefill"]
    assert got.gated_decode == expected["gated_decode"]
    np.testing.assert_allclose(np.array(got.gates, dtype=float),
                               np.array(expected["gates"], dtype=float), atol=1e-4)


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def test_metrics_move(openai_client, server):
    def scrape():
        status, text = http("GET", server.url + "/metrics")
        assert status == 200
        return text

    # Who fills the step's index: the device under vLLM's V2 runner (CUDA), else the host.
    filled = "device" if torch.cuda.is_available() else "host"
    before = scrape()
    chat(openai_client, dynsteer=GATED)
    chat(openai_client, dynsteer=STATIC)
    after = scrape()
    for name, labels in (("dynsteer_requests_steered_total", 'kind="gated"'),
                         ("dynsteer_requests_steered_total", 'kind="static"'),
                         ("dynsteer_tokens_monitored_total", 'site="post_block@1"'),
                         ("dynsteer_worker_host_seconds_count", 'hook="admit"'),
                         ("dynsteer_worker_host_seconds_count", 'hook="step"'),
                         ("dynsteer_worker_host_seconds_sum", 'hook="step"'),
                         ("dynsteer_worker_host_seconds_sum", 'hook="output"'),
                         ("dynsteer_worker_host_seconds_bucket", 'hook="step",le="+Inf"'),
                         ("dynsteer_worker_host_cpu_seconds_total", 'hook="step"'),
                         ("dynsteer_index_fills_total", f'on="{filled}"')):
        assert _metric(after, name, labels) > _metric(before, name, labels), (name, labels)
    if filled == "host":  # the V1 runner has no device fill (under V2 some steps need the host)
        assert _metric(after, "dynsteer_index_fills_total", 'on="device"') == 0
    assert "dynsteer_rows_capacity 64.0" in after
    assert "dynsteer_prefix_guarded_requests_total" in after
    # Gauges of what the workers hold: back at rest once the requests finished.
    for name in ("dynsteer_live_requests", "dynsteer_probe_rows_in_use",
                 "dynsteer_capture_rows_in_use", "dynsteer_steered_requests_live"):
        assert re.search(rf"^{name} 0\.0$", after, re.MULTILINE), name
    assert re.search(r"^dynsteer_global_steerings_held [1-9]", after, re.MULTILINE)


BAD_ROUTE_CALLS = [
    # (method, path, body or raw bytes, api key, status, message fragment)
    ("PUT", "/global", b"{not json", KEY, (400, 422), ""),
    ("PUT", "/global", {"steer": [{"vector": [1.0, 2.0], "layers": [1]}]}, KEY, (400,),
     "steer[0].vector: expected 128 floats"),
    ("PUT", "/global", {"steer": [{"vector": VECTOR, "layers": [9]}]}, KEY, (400,), "layers"),
    ("PUT", "/global", {"steer": []}, None, (401,), "API key"),
    ("PUT", "/global", {"steer": []}, "wrong", (401,), ""),
    ("POST", "/vectors", {"name": "v", "vector": [1.0]}, KEY, (400,), "expected 128 floats"),
    ("POST", "/vectors", {"name": "v", "vector_b64": "@@@"}, KEY, (400,), "vector_b64"),
    ("POST", "/vectors", {"name": "bad name!", "vector": VECTOR}, KEY, (400, 422), "name"),
    ("POST", "/vectors", {"name": "v", "vector": VECTOR, "vector_b64": encode_f32(VECTOR)},
     KEY, (400, 422), "exactly one"),
    ("POST", "/vectors", {"name": "v", "vector": VECTOR}, None, (401,), ""),
    ("POST", "/vectors", {"name": "big", "vector": [0.5] * 20000}, KEY, (413,), "larger than"),
    ("DELETE", "/vectors/nope", None, KEY, (404,), "unknown vector 'nope'"),
    ("GET", "/vectors/nope", None, None, (404,), "unknown vector"),
    ("GET", "/requests/chatcmpl-nope", None, KEY, (404,), "not a recent steered request"),
    ("GET", "/requests/chatcmpl-nope", None, None, (401,), "API key"),
    # One unusable value, one answer on every path (the hostile-client probe got 200 / 500).
    ("PUT", "/global", {"steer": [{"vector": [1e39] * 128, "layers": [1]}]}, KEY, (400,),
     "steer[0].vector[0]: 1e+39 is not finite in float32"),
    ("POST", "/vectors", {"name": "v", "vector": [1e39] * 128}, KEY, (400,),
     "vector[0]: 1e+39 is not finite in float32"),
    ("POST", "/vectors", {"name": "v", "vector_b64": encode_f32([np.inf] * 128)}, KEY, (400,),
     "vector[0]: inf is not finite in float32"),
    ("POST", "/vectors", {"name": "v", "vector": [1e4] * 128}, KEY, (400,), "max_steer_norm"),
    ("PUT", "/global", {"steer": [{"vector": VECTOR, "layers": [1], "scale": 1e20}]}, KEY,
     (400,), "max_steer_norm"),
    ("POST", "/vectors", {"name": "v", "vector": ["1.0"] * 128}, KEY, (400,), "vector[0]"),
    ("POST", "/vectors", {"name": "v", "vector": [True] * 128}, KEY, (400,), "vector[0]"),
    ("PUT", "/global", {"steer": [{"vector": VECTOR, "layers": [True]}]}, KEY, (400,),
     "steer[0].layers[0]"),
    ("POST", "/vectors", {"name": ".hidden", "vector": VECTOR}, KEY, (400,), "name"),
    ("POST", "/vectors", {"name": "..", "vector": VECTOR}, KEY, (400,), "name"),
]


@pytest.mark.parametrize("method,path,body,key,statuses,fragment", BAD_ROUTE_CALLS)
def test_route_errors_are_4xx_with_a_message(server, offline, method, path, body, key,
                                             statuses, fragment):
    raw = body if isinstance(body, bytes) else None
    status, answer = http(method, server.url + "/v1/dynsteer" + path,
                          None if raw else body, raw=raw, api_key=key)
    assert status in statuses, answer
    assert fragment in json.dumps(answer).replace("\\", ""), answer


@pytest.mark.parametrize("spec,fragment", [
    ({"steer": [{"vector": [1.0], "layers": [1]}]}, "dynsteer.steer[0].vector"),
    ({"steer": [{"vector": [1e39] * 128, "layers": [1]}]},
     "dynsteer.steer[0].vector[0]: 1e+39 is not finite in float32"),
    ({"steer": [{"vector": [1e20] * 128, "layers": [1], "scale": 1e20}]},
     "dynsteer.steer[0]: ‖scale · vector‖"),
    ({"steer": [{"vector": "unknown", "layers": [1]}]}, "unknown"),
    ({"gate": {"probe": "nope", "layer": 0, "steer": [{"vector": VECTOR, "layers": [1]}]}},
     "dynsteer.gate.probe"),
    ("{broken", "malformed JSON"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_400_naming_the_field(openai_client, spec, fragment, stream):
    """Streaming too: the 400 comes before a stream starts, not as an event in a 200 one."""
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        chat(openai_client, stream=stream, dynsteer=spec)
    assert fragment in str(info.value)


@pytest.mark.parametrize("key", ["dynsteer_capture", "dynsteer_wire", "dynsteer_registry"])
def test_internal_xargs_keys_from_a_client_are_400(openai_client, key):
    import openai

    with pytest.raises(openai.BadRequestError, match=f"vllm_xargs.{key}: reserved"):
        chat(openai_client, stream=True, vllm_xargs={key: "x"})


def test_a_streamed_steered_chat_equals_the_unstreamed_one(openai_client):
    assert chat(openai_client, stream=True, dynsteer=STATIC)[1] == \
        chat(openai_client, dynsteer=STATIC)[1]


def test_spec_given_twice_is_rejected(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="give it once"):
        chat(openai_client, dynsteer=STATIC, vllm_xargs={"dynsteer": json.dumps(STATIC)})


def test_unsupported_route_and_deep_spec_are_400(server):
    server.wait_ready()
    status, answer = http("POST", server.url + "/v1/responses",
                          {"model": "m", "input": "hi", "dynsteer": STATIC})
    assert status == 400, answer
    assert "not supported on /v1/responses" in answer["error"]["message"]
    deep = '{"model": "m", "messages": [], "dynsteer": ' + "[" * 2000 + "]" * 2000 + "}"
    status, answer = http("POST", server.url + "/v1/chat/completions", raw=deep.encode())
    assert status == 400, answer
    assert answer["error"]["message"] == "dynsteer: JSON nested deeper than 64 levels"


def test_server_keeps_serving_after_errors(openai_client, client):
    assert client.health().status == "ok"
    assert chat(openai_client)[1]
    with pytest.raises(DynsteerHTTPError) as info:
        DynsteerClient(client.base_url).set_global([])
    assert info.value.status == 401
