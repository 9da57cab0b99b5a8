"""Tenant isolation on a real `dynsteer serve` with two API keys, as a hostile client tries it.

Tenant A steers its session ``victim`` over the command socket. Whatever route, JSON encoding
or key another caller uses (tenant B, no key, a route vLLM's ``--api-key`` does not guard), it
cannot ride that session by sending A's namespaced name for it: the session is namespaced at
admission by the key that authenticated the request, not in the request's bytes. The oracle is
the server's own count of steered requests (``dynsteer_requests_steered_total``, which counts
session steering), with a positive control per route: the caller's own session there moves it.
"""

from __future__ import annotations

import json
import re

import msgspec
import numpy as np
import pytest
import zmq
from server_utils import Server, http

from dynsteer.controller.zmq_protocol import Reply, SetSession, encode
from dynsteer.engine_ext.server.sessions import key_namespace

pytestmark = pytest.mark.engine

A, B = "tenantA", "tenantB"
STEER = [{"vector": (np.random.default_rng(5).standard_normal(128) * 6).tolist(),
          "layers": [2]}]
VICTIM = key_namespace(A) + "victim"
"""A's session as events name it (what a hostile client may have seen)."""
ESCAPED = "\\u0064ynsteer"
"""``dynsteer`` as a JSON escape."""


def command(address: str, message) -> Reply:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        dealer.connect(address)
        dealer.send(encode(message))
        return Reply.model_validate(msgspec.msgpack.decode(dealer.recv()))
    finally:
        dealer.close()
        context.term()


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    commands = f"ipc://{folder / 'commands'}"  # no loopback port another engine could take first
    srv = Server(chat_model, folder / "serve.log",
                 "--api-key", A, B, "--dynsteer-commands", commands)
    try:
        srv.wait_ready(api_key=A)
        for key, session in ((A, "victim"), (B, "mine")):
            reply = command(commands, SetSession(id=key, session=session, steer=STEER,
                                                 api_key=key))
            assert reply.ok, reply.error
        srv.model = http("GET", srv.url + "/v1/models", api_key=A)[1]["data"][0]["id"]
        yield srv
    finally:
        srv.stop()


def steered(server) -> float:
    """Requests the server counted as steered (static: session steering is static here)."""
    text = http("GET", server.url + "/metrics")[1]
    found = re.search(r'^dynsteer_requests_steered_total\{kind="static"\} (\S+)$', text,
                      re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def xargs(session: str) -> dict:
    return {"vllm_xargs": {"dynsteer": json.dumps({"session": session})}}


def completion(server, session: str) -> dict:
    return {"model": server.model, "prompt": "Tell me about the sea", "max_tokens": 4,
            "temperature": 0.0, "logprobs": 1, **xargs(session)}


def post(server, path: str, body: dict | bytes, key: str | None) -> tuple[int, object]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http("POST", server.url + path, raw=raw, api_key=key)


def bodies(server, session: str) -> dict[str, dict]:
    """A body of each generating route, carrying ``session``."""
    chat = [{"role": "user", "content": "Tell me about the sea"}]
    return {
        "/v1/completions": completion(server, session),
        "/v1/chat/completions": {"model": server.model, "messages": chat, "max_tokens": 4,
                                 **xargs(session)},
        "/v1/responses": {"model": server.model, "input": "Tell me about the sea",
                          "max_output_tokens": 4, **xargs(session)},
        "/v1/chat/completions/batch": {"model": server.model, "messages": [chat, chat],
                                       "max_tokens": 4, **xargs(session)},
    }


def check_steers(server, path: str, body: dict | bytes, key: str | None, expected: int) -> None:
    before = steered(server)
    status, reply = post(server, path, body, key)
    assert status == 200, (path, reply)
    assert steered(server) - before == expected, (path, key)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/v1/chat/completions/batch"])
def test_another_tenants_session_name_steers_nothing_on_any_route(server, path):
    """B's own session steers B's request on this route (one steered request per prompt);
    A's namespaced name, sent by B, steers nothing."""
    prompts = 2 if path.endswith("/batch") else 1
    check_steers(server, path, bodies(server, "mine")[path], B, prompts)
    check_steers(server, path, bodies(server, VICTIM)[path], B, 0)
    check_steers(server, path, bodies(server, "victim")[path], A, prompts)


def test_the_unguarded_invocations_route_runs_as_the_keyless_caller(server):
    """vLLM's ``--api-key`` does not guard ``/invocations``: it is served, with the keyless
    namespace, so A's name (or its bare name) reaches nothing of A's."""
    for session in (VICTIM, "victim"):
        check_steers(server, "/invocations", completion(server, session), None, 0)


def test_escaped_and_utf16_bodies_are_namespaced_like_any_other(server):
    escaped = json.dumps(completion(server, VICTIM)).replace('"dynsteer', f'"{ESCAPED}')
    check_steers(server, "/v1/completions", escaped.encode(), B, 0)
    own = json.dumps(completion(server, "mine")).replace('"dynsteer', f'"{ESCAPED}')
    check_steers(server, "/v1/completions", own.encode(), B, 1)
    utf16 = json.dumps(completion(server, VICTIM)).encode("utf-16")
    check_steers(server, "/v1/completions", utf16, B, 0)
    check_steers(server, "/v1/completions", json.dumps(completion(server, "mine")).encode(
        "utf-16"), B, 1)


def test_reserved_keys_are_refused_by_parsed_key(server):
    for key in ("dynsteer_capture", f"{ESCAPED}_capture"):
        body = json.dumps({**completion(server, "x"), "vllm_xargs": {"K": "1:0"}})
        status, reply = post(server, "/v1/completions", body.replace('"K"', f'"{key}"').encode(),
                             B)
        assert status == 400, reply
        assert "vllm_xargs.dynsteer_capture: reserved" in reply["error"]["message"]


BAD = json.dumps({"steer": [{"vector": "unknown", "layers": [1]}]})


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
])
def test_bad_specs_are_400_on_every_route_and_stream_mode(server, path, body):
    text = json.dumps({"model": server.model, **body, "vllm_xargs": {"dynsteer": BAD}})
    for raw in (text, text.replace('"dynsteer', f'"{ESCAPED}')):
        status, reply = post(server, path, raw.encode(), B)
        assert status == 400, (path, reply)
        assert "unknown vector name 'unknown'" in reply["error"]["message"]


def test_session_names_are_checked_as_the_client_sent_them(server):
    status, reply = post(server, "/v1/completions", completion(server, ""), B)
    assert status == 400 and "session" in reply["error"]["message"], reply
    status, _ = post(server, "/v1/completions", completion(server, "s" * 256), B)
    assert status == 200
    status, reply = post(server, "/v1/completions", completion(server, "s" * 257), B)
    assert status == 400 and "session" in reply["error"]["message"], reply


def test_session_steering_shows_in_request_telemetry(server):
    status, reply = post(server, "/v1/completions", completion(server, "mine"), B)
    assert status == 200
    status, report = http("GET", f"{server.url}/v1/dynsteer/requests/{reply['id']}", api_key=B)
    assert status == 200 and report["static"] and not report["gated"], report


SKIPPED = re.compile(r"^/v1/dynsteer/|sleep|wake|pause|resume|reset|scale|shutdown|collective"
                     r"|load_lora|unload_lora|start_profile|stop_profile|update_weights"
                     r"|init_weight|/abort")
"""Routes that change the server itself (or are ours, which take no spec)."""


def test_no_route_of_the_openapi_schema_lets_a_namespaced_session_through(server):
    """Every POST route (``/invocations`` too, which reads its body itself), with the body of
    each generating route carrying A's namespaced session, sent by B and by nobody: nothing is
    steered and nothing fails with a 5xx. Each generating route served its own shape (so the
    sweep reached the engine), and A's own session through them is counted."""
    schema = http("GET", server.url + "/openapi.json", api_key=A)[1]
    routes = sorted(path for path, ops in schema["paths"].items()
                    if "post" in ops and not SKIPPED.search(path))
    assert {"/v1/completions", "/v1/responses", "/invocations"} <= set(routes)
    shapes = bodies(server, VICTIM)
    before = steered(server)
    statuses = {(path, key, shape): post(server, path, body, key)[0]
                for path in routes for key in (B, None) for shape, body in shapes.items()}
    assert steered(server) == before, statuses
    assert not [k for k, status in statuses.items() if status >= 500], statuses
    served = {path for (path, _, _), status in statuses.items() if status == 200}
    assert set(shapes) | {"/invocations"} <= served, statuses
    for path, body in bodies(server, "victim").items():
        post(server, path, body, A)
    assert steered(server) >= before + 5  # one a prompt: the batch has two
    assert http("GET", server.url + "/v1/dynsteer/health", api_key=A)[0] == 200
