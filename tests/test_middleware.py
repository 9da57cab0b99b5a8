"""DynsteerMiddleware in front of a tiny echo app: no vLLM engine, no server process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from dynsteer.controller.spec import MAX_JSON_DEPTH
from dynsteer.engine_ext.frontend import admission, caller
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.frontend.caller import acting_as
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server import sessions
from dynsteer.engine_ext.server.middleware import DynsteerMiddleware, check_body
from dynsteer.engine_ext.server.sessions import ANONYMOUS, key_namespace

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
    def move(body: bytes) -> bytes:
        return check_body("/v1/completions", body, None).body

    as_string = json.dumps({"dynsteer": json.dumps(SPEC)}).encode()
    assert json.loads(move(as_string))["vllm_xargs"]["dynsteer"] == json.dumps(SPEC)
    plain = b'{"model": "m", "messages": []}'
    assert move(plain) is plain
    assert move(b'{"x": "dynsteer"') == b'{"x": "dynsteer"'


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


TENANT = sessions.client("k", ["k", "other"])
"""The caller presenting configured key ``k``."""
KEYLESS = sessions.client(None, ["k", "other"])
"""A caller without a configured key, while keys are configured."""


def completion(spec=None, **xargs) -> bytes:
    if spec is not None:
        xargs["dynsteer"] = spec
    return json.dumps({"model": "m", "stream": True, "vllm_xargs": xargs}).encode()


def check_completion(body: bytes, state: FrontendState, who: caller.Caller = KEYLESS) -> bytes:
    """The completion route's check, as ``who``."""
    with acting_as(who):
        return check_body("/v1/completions", body, state).body


def admitted_session(state: FrontendState, spec: dict, who: caller.Caller) -> str:
    with acting_as(who):
        return admission.admit(state, {"dynsteer": json.dumps(spec)})[1]["session"]


def test_sessions_are_in_the_callers_namespace_at_admission():
    """With API keys, a spec's session is the bearer's namespace of it, however the request
    came (the check leaves the body's bytes alone); without keys, the name as given."""
    state = frontend()
    spec = {"session": "s1", **SPEC}
    assert admitted_session(state, spec, TENANT) == key_namespace("k") + "s1"
    assert admitted_session(state, spec, sessions.client("other", ["k", "other"])) \
        == key_namespace("other") + "s1"
    assert admitted_session(state, spec, sessions.client(None, [])) == "s1"
    assert admitted_session(state, spec, caller.TRUSTED) == "s1"
    body = completion(json.dumps(spec))
    assert check_completion(body, state, TENANT) is body


def test_callers_without_a_key_cannot_join_a_tenants_session():
    """A request without a configured key (or with a wrong one) that sends a tenant's
    namespaced session name gets the anonymous namespace of that name, never the tenant's
    session; a tenant sending another's name gets its own namespace of it."""
    state = frontend()
    tenants = TENANT.session("s1")
    for who in (KEYLESS, sessions.client("wrong", ["k", "other"])):
        got = admitted_session(state, {"session": tenants}, who)
        assert got == ANONYMOUS + tenants != tenants
    other = admitted_session(state, {"session": tenants}, sessions.client("other", ["k", "other"]))
    assert other != tenants and other.startswith(key_namespace("other"))
    # The client's name is what the 256-character limit and the pattern apply to.
    assert admitted_session(state, {"session": "x" * 256}, TENANT).endswith("x" * 256)
    for bad in ("", "x" * 257):
        with pytest.raises(ValueError, match="session"), acting_as(TENANT):
            admission.admit(state, {"dynsteer": {"session": bad}})


def test_a_request_that_lost_its_caller_is_admitted_as_the_engines_default():
    """The server's default is a keyless client (fail closed); the offline API's the owner."""
    state = frontend()
    assert admission.admit(state, {"dynsteer_capture": "1:0"}) is None
    state.default_caller = KEYLESS
    with pytest.raises(ValueError, match=r"dynsteer_capture: reserved"):
        admission.admit(state, {"dynsteer_capture": "1:0"})
    got = admission.admit(state, {"dynsteer": {"session": TENANT.session("s")}})[1]
    assert got["session"].startswith(ANONYMOUS)


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
    moved = json.loads(check_body("/v1/completions", nan, None).body)["vllm_xargs"]["dynsteer"]
    assert np.isnan(json.loads(moved)["steer"][0]["vector"][1])
    with pytest.raises(ValueError, match=named):
        check_completion(nan, frontend())
    with_session = nan.replace(b'{"steer"', b'{"session": "s", "steer"')
    with pytest.raises(ValueError, match=named):
        check_completion(with_session, frontend(), TENANT)
    strict = json.dumps({"model": "m", "dynsteer": SPEC}).encode()
    assert json.loads(json.loads(check_completion(strict, frontend()))["vllm_xargs"]["dynsteer"]) \
        == SPEC


ESCAPED = "\\u0064ynsteer"
"""``dynsteer`` as a JSON escape: the same key to any JSON parser, other bytes."""


@pytest.mark.parametrize("encode", [
    lambda body: body.replace(b'"dynsteer', f'"{ESCAPED}'.encode()),
    lambda body: body.decode().encode("utf-16"),
    lambda body: body.decode().encode("utf-32-le"),
])
def test_a_spec_in_any_json_encoding_is_checked(encode):
    """The check reads the JSON, not its bytes: an escaped key, a UTF-16 or UTF-32 body carry
    a spec (and a reserved key) as well as plain UTF-8 does."""
    state = frontend()
    bad = encode(completion({"steer": [{"vector": "unknown", "layers": [1]}]}))
    with pytest.raises(ValueError, match="unknown"):
        check_completion(bad, state)
    with pytest.raises(ValueError, match=r"vllm_xargs\.dynsteer_capture: reserved"):
        check_completion(encode(completion(**{"dynsteer_capture": "1:0"})), state)
    top_level = encode(json.dumps({"model": "m", "dynsteer": SPEC}).encode())
    moved = json.loads(check_completion(top_level, state))
    assert json.loads(moved["vllm_xargs"]["dynsteer"]) == SPEC
    with pytest.raises(ValueError, match="not supported on /v1/responses"):
        check_body("/v1/responses", top_level, state)


def test_bodies_that_cannot_name_the_spec_are_not_parsed():
    state = frontend()
    plain = json.dumps({"model": "m", "vllm_xargs": {"other": 1}, "prompt": "hi"}).encode()
    assert check_completion(plain, state) is plain
    assert state.counters.requests_rejected == 0


async def report_caller(request: Request) -> Response:
    """Echo the caller that admission would see for this request."""
    who = caller.current(caller.TRUSTED)
    return Response(json.dumps({"namespace": who.namespace, "client": who.client}))


def test_every_route_runs_as_the_caller_of_its_bearer_key():
    """The caller is set for the whole request, whatever the route: routes vLLM does not guard
    (``/invocations``) get the keyless namespace, a wrong key too."""
    app = Starlette(routes=[Route("/{path:path}", report_caller, methods=["GET", "POST"])])
    app.state.dynsteer = SimpleNamespace(api_keys=["k", "other"], frontend=frontend())
    app.add_middleware(DynsteerMiddleware, max_body_bytes=DYNSTEER_CAP,
                       max_request_bytes=REQUEST_CAP)
    with TestClient(app) as http:
        for path in ("/v1/responses", "/invocations", "/v1/chat/completions/batch", "/x"):
            for key, namespace in (("k", key_namespace("k")), ("other", key_namespace("other")),
                                   ("wrong", ANONYMOUS), (None, ANONYMOUS)):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                got = http.post(path, content=b"{}", headers=headers).json()
                assert got == {"namespace": namespace, "client": True}, (path, key)
