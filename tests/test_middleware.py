"""DynsteerMiddleware in front of a tiny echo app: no vLLM engine, no server process."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from dynsteer.controller.spec import MAX_JSON_DEPTH
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.middleware import (
    DynsteerMiddleware,
    check_completion,
    move_spec_to_xargs,
)
from dynsteer.engine_ext.server.sessions import anonymous, namespaced

DYNSTEER_CAP = 4096
REQUEST_CAP = 64 * 1024
SPEC = {"steer": [{"vector": "calm", "layers": [1]}]}
SUPPORTED = "send steered requests to /v1/chat/completions or /v1/completions"


async def echo(request: Request) -> Response:
    body = await request.body()
    return Response(body, headers={"x-echo-length": str(len(body)),
                                   "x-content-length": request.headers.get("content-length", "")})


def make_app() -> DynsteerMiddleware:
    app = Starlette(routes=[Route("/{path:path}", echo, methods=["GET", "POST", "PUT", "PATCH"])])
    return DynsteerMiddleware(app, max_body_bytes=DYNSTEER_CAP, max_request_bytes=REQUEST_CAP)


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def message_of(response) -> str:
    return response.json()["error"]["message"]


def test_small_bodies_pass_untouched(client):
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize"):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        r = client.post(path, content=body)
        assert r.status_code == 200 and r.content == body.encode(), path
    # The bytes appear, but not as a top-level key: untouched everywhere.
    inner = json.dumps({"metadata": {"dynsteer": 1}, "text": 'say "dynsteer"'}).encode()
    for path in ("/v1/responses", "/v1/chat/completions"):
        assert client.post(path, content=inner).content == inner


def test_deep_nesting_with_the_marker_is_400_naming_dynsteer(client):
    for depth in (MAX_JSON_DEPTH + 1, 2500):
        body = '{"model": "m", "dynsteer": {"steer": ' + nested(depth) + "}}"
        r = client.post("/v1/chat/completions", content=body)
        assert r.status_code == 400, r.text
        assert message_of(r) == f"dynsteer: JSON nested deeper than {MAX_JSON_DEPTH} levels"
        assert "Traceback" not in r.text and "recursion" not in r.text
    # Deep elsewhere, with the spec given through vllm_xargs: still bounded.
    body = json.dumps({"vllm_xargs": {"dynsteer": "{}"}, "x": json.loads(nested(3000 // 4))})
    assert client.post("/v1/chat/completions", content=body).status_code == 400
    # Brackets inside strings (escaped quotes included) do not count.
    text = '\\"' + "[" * 5000 + '\\"'
    body = '{"dynsteer": {"steer": []}, "messages": [{"content": "' + text + '"}]}'
    r = client.post("/v1/chat/completions", content=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.content)["messages"][0]["content"] == json.loads(f'"{text}"')


def test_deep_nesting_without_the_marker_passes_through(client):
    body = ('{"model": "m", "messages": [], "x": ' + nested(3000) + "}").encode()
    for path in ("/v1/chat/completions", "/v1/responses"):
        r = client.post(path, content=body)
        assert r.status_code == 200 and r.content == body, path


def test_spec_at_the_limit_depth_is_moved(client):
    deepest = json.loads(nested(MAX_JSON_DEPTH - 2))
    body = json.dumps({"dynsteer": {"x": deepest}})
    r = client.post("/v1/chat/completions", content=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["vllm_xargs"]["dynsteer"]) == {"x": deepest}


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/invocations",
                                  "/v1/chat/completions/batch", "/v1/embeddings", "/pooling"])
def test_top_level_spec_elsewhere_is_400_naming_the_routes(client, path):
    r = client.post(path, json={"model": "m", "input": "hi", "dynsteer": SPEC})
    assert r.status_code == 400, r.text
    message = message_of(r)
    assert message.startswith(f"dynsteer: not supported on {path};")
    assert SUPPORTED in message and 'top-level "dynsteer" or vllm_xargs' in message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_top_level_spec_moves_into_vllm_xargs(client, path):
    r = client.post(path, json={"model": "m", "dynsteer": SPEC, "vllm_xargs": {"other": 1}})
    assert r.status_code == 200, r.text
    received = r.json()
    assert "dynsteer" not in received
    xargs = received["vllm_xargs"]
    assert xargs.keys() == {"other", "dynsteer"} and xargs["other"] == 1
    assert json.loads(xargs["dynsteer"]) == SPEC  # the spec's JSON text
    assert r.headers["x-content-length"] == str(len(r.content))
    r = client.post(path, json={"dynsteer": SPEC, "vllm_xargs": {"dynsteer": "{}"}})
    assert r.status_code == 400 and "give it once" in message_of(r)


def test_spec_as_a_string_is_moved_as_is_and_other_bodies_are_not_rewritten():
    """The rewrite itself: a spec given as its JSON string is not encoded again; a body with no
    top-level spec (or that is not JSON) comes back as the same bytes."""
    as_string = json.dumps({"dynsteer": json.dumps(SPEC)}).encode()
    assert json.loads(move_spec_to_xargs(as_string))["vllm_xargs"]["dynsteer"] == json.dumps(SPEC)
    plain = b'{"model": "m", "messages": []}'
    assert move_spec_to_xargs(plain) is plain
    assert move_spec_to_xargs(b'{"x": "dynsteer"') == b'{"x": "dynsteer"'


def test_body_over_the_cap_is_413_by_content_length(client):
    body = json.dumps({"messages": [{"content": "x" * REQUEST_CAP}]})
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/audio/transcriptions"):
        r = client.post(path, content=body)
        assert r.status_code == 413, path
        assert "DYNSTEER_MAX_REQUEST_BYTES" in message_of(r)
        assert "--dynsteer-max-request-bytes" in message_of(r)
    r = client.put("/v1/dynsteer/global", content=b"x" * (DYNSTEER_CAP + 1))
    assert r.status_code == 413 and "DYNSTEER_MAX_BODY_BYTES" in message_of(r)
    # At the cap exactly: accepted.
    exact = b" " * (REQUEST_CAP - 2) + b"{}"
    assert client.post("/v1/chat/completions", content=exact).content == exact


def test_body_over_the_cap_is_413_while_streaming(client):
    def chunks():
        for _ in range(1000):  # 1000 KiB in all, no Content-Length
            yield b"x" * 1024

    r = client.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413 and "DYNSTEER_MAX_REQUEST_BYTES" in message_of(r)

    def small():
        yield b'{"model": "m", '
        yield b'"messages": []}'

    r = client.post("/v1/completions", content=small())
    assert r.status_code == 200 and r.content == b'{"model": "m", "messages": []}'


def test_lying_content_length_is_still_capped():
    """The body is counted while read, whatever Content-Length said; reading stops there."""
    import asyncio

    app = make_app()
    messages = [{"type": "http.request", "body": b"x" * 1024, "more_body": True}] * 100
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict] = []
    pulled = 0

    async def run() -> None:
        queue = iter(messages)

        async def receive():
            nonlocal pulled
            pulled += 1
            return next(queue)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "root_path": "", "query_string": b"", "headers": [(b"content-length", b"10")]}
        await app(scope, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 413
    assert pulled == REQUEST_CAP // 1024 + 1


def test_get_and_other_methods_are_not_touched(client):
    r = client.get("/v1/models")
    assert r.status_code == 200


def test_request_cap_setting_env_flag_and_default():
    from dynsteer.engine_ext.server.cli import ServeError, help_text, prepare
    from dynsteer.engine_ext.server.settings import ServerSettings

    assert ServerSettings().max_request_bytes == 32 * 1024 * 1024
    s = ServerSettings.from_env({"DYNSTEER_MAX_REQUEST_BYTES": "2048"})
    assert s.max_request_bytes == 2048
    with pytest.raises(ValueError, match="DYNSTEER_MAX_REQUEST_BYTES"):
        ServerSettings.from_env({"DYNSTEER_MAX_REQUEST_BYTES": "12"})
    env: dict[str, str] = {}
    prepare(["/m", "--dynsteer-max-request-bytes", "8192"], env)
    assert env["DYNSTEER_MAX_REQUEST_BYTES"] == "8192"
    with pytest.raises(ServeError, match="DYNSTEER_MAX_REQUEST_BYTES"):
        prepare(["/m", "--dynsteer-max-request-bytes=lots"], {})
    assert "--dynsteer-max-request-bytes" in help_text()


HIDDEN = 8


def frontend() -> FrontendState:
    """A frontend of a 2-layer model (hidden 8) with vector ``calm`` registered."""
    state = FrontendState(options=EngineOptions(max_rows=4), hidden_size=HIDDEN, num_layers=2,
                          sites=(("post_block", 0), ("post_block", 1)), dtype_max=65504.0)
    state.vectors["calm"] = np.ones(HIDDEN, dtype=np.float32)
    state.vector_norms["calm"] = float(np.sqrt(HIDDEN))
    return state


KEYED = functools.partial(namespaced, api_key="k")
"""The namespace of a caller presenting configured key ``k``."""


def completion(spec=None, **xargs) -> bytes:
    if spec is not None:
        xargs["dynsteer"] = spec
    return json.dumps({"model": "m", "stream": True, "vllm_xargs": xargs}).encode()


def test_sessions_move_into_the_callers_namespace():
    """With API keys, a spec's session becomes the bearer's namespace of it (top-level spec
    already moved into vllm_xargs, or given there); a body without a session is unchanged,
    and so is one when no keys are configured (no namespace)."""
    for spec in ({"session": "s1"}, json.dumps({"session": "s1", **SPEC})):
        got = json.loads(json.loads(check_completion(completion(spec), frontend(), KEYED))
                         ["vllm_xargs"]["dynsteer"])
        assert got["session"] == namespaced("s1", "k") != "s1"
    plain = completion(json.dumps(SPEC))
    assert check_completion(plain, frontend(), KEYED) is plain
    open_server = completion(json.dumps({"session": "s1", **SPEC}))
    assert check_completion(open_server, frontend()) is open_server


def test_callers_without_a_key_cannot_join_a_tenants_session():
    """A request without a configured key that sends a tenant's namespaced session name gets
    the anonymous namespace of that name, never the tenant's session."""
    tenants = namespaced("s1", "k")
    got = json.loads(json.loads(check_completion(completion({"session": tenants}), frontend(),
                                                 anonymous))["vllm_xargs"]["dynsteer"])
    assert got["session"] == anonymous(tenants) != tenants
    assert namespaced(got["session"], "k") != tenants


@pytest.mark.parametrize("spec,fragment", [
    ({"steer": [{"vector": [1.0], "layers": [1]}]}, "dynsteer.steer[0].vector"),
    ({"steer": [{"vector": "unknown", "layers": [1]}]}, "unknown"),
    ({"steer": [{"vector": "calm", "layers": [7]}]}, "layers"),
    ("{broken", "malformed JSON"),
])
def test_bad_specs_are_refused_before_the_route_answers(spec, fragment):
    """What admission would refuse is refused here (the server turns it into a 400 before a
    stream starts), with admission's message; a good spec passes and is parsed once."""
    state = frontend()
    with pytest.raises(ValueError) as info:
        check_completion(completion(spec), state)
    assert fragment in str(info.value)
    assert state.counters.requests_rejected == 1
    good = completion(json.dumps(SPEC))
    assert check_completion(good, state) is good
    assert len(state.parsed) == 1


def test_a_spec_needing_more_rows_than_the_engine_has_is_refused():
    """Prefill and decode steered differently take two rows; the engine has one."""
    many = {"steer": [{"vector": [float(i)] * HIDDEN, "layers": [1], "phase": phase}
                      for i, phase in ((1, "prefill"), (2, "decode"))]}
    state = frontend()
    state.options = EngineOptions(max_rows=1)
    with pytest.raises(ValueError, match="max_rows"):
        check_completion(completion(many), state)


@pytest.mark.parametrize("key", ["dynsteer_capture", "dynsteer_wire", "dynsteer_cache",
                                 "dynsteer_rows", "dynsteer_global", "dynsteer_registry"])
def test_reserved_xargs_keys_are_refused(key):
    """Only the frontend sets dynsteer's internal keys: a client's is refused, naming it."""
    with pytest.raises(ValueError, match=f"vllm_xargs.{key}: reserved"):
        check_completion(completion(**{key: "x"}), frontend())
    with pytest.raises(ValueError, match=f"vllm_xargs.{key}: reserved"):
        check_completion(completion(json.dumps(SPEC), **{key: "x"}), frontend())


def test_a_top_level_spec_is_moved_checked_and_written_once():
    """On a server the completion check also moves a top-level spec into ``vllm_xargs`` (one
    parse); given both ways it is refused."""
    state = frontend()
    body = json.dumps({"model": "m", "dynsteer": SPEC}).encode()
    moved = json.loads(check_completion(body, state))
    assert "dynsteer" not in moved and json.loads(moved["vllm_xargs"]["dynsteer"]) == SPEC
    assert len(state.parsed) == 1
    twice = json.dumps({"model": "m", "dynsteer": SPEC,
                        "vllm_xargs": {"dynsteer": json.dumps(SPEC)}}).encode()
    with pytest.raises(ValueError, match="give it once"):
        check_completion(twice, state)


def test_what_strict_json_refuses_reaches_validation_as_json_reads_it():
    """Bodies are read and written by msgspec where they are strict JSON; a ``NaN`` (which
    vLLM's parser, json, reads) takes json both ways, so validation sees a NaN, not a null,
    and names the element. A strict body's spec comes back as the same values."""
    # a null would read "a valid number": this names the NaN itself
    named = r"dynsteer.steer\[0\].vector\[1\]: Input should be a finite"
    nan = b'{"model": "m", "dynsteer": {"steer": [{"vector": [1.0, NaN], "layers": [0]}]}}'
    moved = json.loads(move_spec_to_xargs(nan))["vllm_xargs"]["dynsteer"]
    assert np.isnan(json.loads(moved)["steer"][0]["vector"][1])
    with pytest.raises(ValueError, match=named):
        check_completion(nan, frontend())
    with_session = nan.replace(b'{"steer"', b'{"session": "s", "steer"')
    with pytest.raises(ValueError, match=named):
        check_completion(with_session, frontend(), KEYED)  # namespaced: written back by json
    strict = json.dumps({"model": "m", "dynsteer": SPEC}).encode()
    assert json.loads(json.loads(check_completion(strict, frontend()))["vllm_xargs"]["dynsteer"]) \
        == SPEC
