"""One pure-ASGI middleware for what routes cannot do themselves.

* Every HTTP request runs as its caller (:func:`.sessions.client` of its bearer key, in a
  context variable that follows it into admission, see
  :mod:`dynsteer.engine_ext.frontend.caller`): whatever the route or the body's encoding, a
  spec's ``session`` is namespaced by the key that authenticated the request (the keyless
  namespace without one, on routes vLLM's ``--api-key`` does not guard too), and dynsteer's
  reserved ``vllm_xargs`` keys (``dynsteer_*``) are refused by parsed key.
* ``POST /v1/chat/completions`` and ``/v1/completions`` with a top-level ``dynsteer`` object
  (OpenAI clients' ``extra_body``): the object moves into ``vllm_xargs["dynsteer"]`` as JSON,
  the path vLLM already carries into ``SamplingParams.extra_args``, so both ways of passing a
  spec meet the same validation. Every other POST with a top-level ``dynsteer`` object is HTTP
  400 naming the routes that take it (vLLM would ignore the unknown field and answer
  unsteered). Bodies with a ``vllm_xargs`` spec are checked as admission will check them, on
  every route (HTTP 400 naming the field), before vLLM answers: a streaming request gets its
  400, not an error event in a 200 stream. Only bodies that may name ``dynsteer``
  (:func:`_may_carry_spec`) are parsed; they are first checked to nest at most
  ``MAX_JSON_DEPTH`` levels (HTTP 400 above).
* Request bodies are capped before anything parses them (HTTP 413, from Content-Length, then
  while reading): ``max_body_bytes`` on ``/v1/dynsteer/`` routes, ``max_request_bytes`` on
  every other POST, PUT and PATCH (vLLM's routes, completions included).
* A completion whose spec has ``capture`` gets its activations in its JSON response
  (:mod:`.activations`).
* ``GET /metrics`` first refreshes the workers' counters, so a scrape sees current values.

Error bodies carry our message only, in vLLM's ``{"error": {...}}`` shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynsteer.controller.contract import SpecError
from dynsteer.controller.extra_args import SPEC_KEY
from dynsteer.controller.spec import MAX_JSON_DEPTH, check_json_depth

from ..frontend import admission
from ..frontend.admission import FrontendState
from ..frontend.caller import acting_as
from ..frontend.global_capture import capture_for
from .activations import with_activations
from .routes import PREFIX
from .sessions import client
from .settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_BODY_ENV,
    MAX_REQUEST_ENV,
)

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
"""The routes that take a spec (top-level ``dynsteer`` or ``vllm_xargs["dynsteer"]``)."""
BODY_METHODS = ("POST", "PUT", "PATCH")
_SPEC_BYTES = SPEC_KEY.encode()
_ERROR_TYPES = {400: "BadRequestError", 413: "RequestTooLargeError"}


class BodyTooLarge(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPES[status],
                                   "code": status}}, status_code=status)


async def _read_body(receive: Receive, limit: int | None) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)  # one chunk: that very object, no copy


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then defers to the client's (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class _Json(NamedTuple):
    """JSON read, and the encoder that writes it back as the same JSON."""

    data: Any
    dumps: Callable[[Any], bytes]


def _json_dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _loads(text: bytes | str) -> _Json:
    """``text`` read as JSON. Strict JSON is read and written by msgspec: a spec's base64
    vector (~22 kB) costs json ~60 µs to write, on the API server's event loop, which streams
    every request's tokens; msgspec takes a tenth. What msgspec refuses but vLLM's parser
    (json) reads (``NaN``, ``Infinity``, numbers past float64, lone surrogates) goes through
    json both ways, so its values reach validation as they are. ValueError when neither
    reads it (RecursionError: json's nesting limit)."""
    try:
        return _Json(msgspec.json.decode(text), msgspec.json.encode)
    except msgspec.DecodeError:
        return _Json(json.loads(text), _json_dumps)


def _may_carry_spec(body: bytes) -> bool:
    """Whether a body may hold a key that spells ``dynsteer``: literally, through a ``\\u``
    escape, or in UTF-16/32 (JSON's other encodings, which vLLM's parser reads as well; a NUL
    among the first four bytes gives them away). Other bodies pass unparsed."""
    return _SPEC_BYTES in body or b"\\u" in body or b"\x00" in body[:4]


def _json_object(body: bytes) -> _Json | None:
    """The body's JSON object (:func:`_loads`); None when the body is not JSON or not an
    object (vLLM reports it). :class:`SpecError` when it nests deeper than ``MAX_JSON_DEPTH``
    (checked on the bytes first, so a hostile depth never reaches the parser)."""
    check_json_depth(body, SPEC_KEY)
    try:
        found = _loads(body)
    except RecursionError:
        raise SpecError(f"{SPEC_KEY}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        return None
    return found if isinstance(found.data, dict) else None


def _move_into_xargs(found: _Json) -> None:
    """Move a top-level spec into ``vllm_xargs`` (in place; nothing when ``vllm_xargs`` is not
    an object: vLLM reports that)."""
    data = found.data
    xargs = data.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return
    if SPEC_KEY in xargs:
        raise SpecError(f"{SPEC_KEY}: given both as a top-level field and in vllm_xargs; "
                        "give it once")
    spec = data.pop(SPEC_KEY)
    xargs[SPEC_KEY] = spec if isinstance(spec, str) else found.dumps(spec).decode()
    data["vllm_xargs"] = xargs


class Checked(NamedTuple):
    """A body as the app should see it, and whether its request captures activations (into
    which sink, None: into the response; and whether the response is streamed)."""

    body: bytes
    captures: bool = False
    sink: str | None = None
    streamed: bool = False
    live: bool = False
    """Whether a streamed response carries the rows as they are computed."""
    n: int = 1
    """Completions per prompt (each captures its own rows)."""


def _with_global_capture(found: _Json, frontend: FrontendState) -> bool:
    """Add the server's global capture to a completion where it applies
    (:func:`..frontend.global_capture.capture_for`), in place; whether the body changed."""
    data = found.data
    xargs = data.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return False
    raw = xargs.get(SPEC_KEY)
    spec = _loads(raw).data if isinstance(raw, (str, bytes)) else {}
    if not isinstance(spec, dict):
        return False
    capture = capture_for(frontend, spec)
    if capture is None:
        return False
    spec["capture"] = capture
    xargs[SPEC_KEY] = found.dumps(spec).decode()
    data["vllm_xargs"] = xargs
    return True


def check_body(path: str, body: bytes, frontend: FrontendState | None) -> Checked:
    """``body`` as the app should see it on ``POST path`` (outside ``/v1/dynsteer/``), refused
    (:class:`SpecError`, a ValueError naming the field) where admission would refuse it.

    A top-level ``dynsteer`` object moves into ``vllm_xargs`` on the completion routes and is
    refused on any other. ``vllm_xargs`` is checked as admission will check it, on every route
    (``frontend``; None: dynsteer is not enabled on the engine), before vLLM answers: a
    streaming request with a bad spec gets its 400, not an error event in a 200 stream. The
    caller (its session namespace, its right to reserved keys) is the one in context, as at
    admission. The body is parsed only when it may name ``dynsteer`` and written again only
    when the spec moved. With a global capture set (``frontend.global_capture``), every
    completion that asks for no capture gets it."""
    completion = path.rstrip("/") in COMPLETION_PATHS
    global_capture = frontend.global_capture if frontend is not None and completion else None
    if not _may_carry_spec(body) and global_capture is None:
        return Checked(body)
    found = _json_object(body)
    if found is None:
        return Checked(body)
    moved = SPEC_KEY in found.data
    if moved:
        if not completion:
            raise SpecError(
                f"{SPEC_KEY}: not supported on {path}; send steered requests to "
                f"{' or '.join(COMPLETION_PATHS)} (top-level \"{SPEC_KEY}\" or vllm_xargs)")
        _move_into_xargs(found)
    if global_capture is not None and _with_global_capture(found, frontend):
        moved = True
    xargs = found.data.get("vllm_xargs")
    spec = None
    if frontend is not None and isinstance(xargs, dict):
        spec = admission.precheck(frontend, xargs)
    capture = spec.capture if spec is not None else None
    n = found.data.get("n")
    return Checked(found.dumps(found.data) if moved else body, capture is not None,
                   capture.sink if capture is not None else None,
                   bool(found.data.get("stream")), capture is not None and capture.streams,
                   n if isinstance(n, int) and n > 1 else 1)


def _bearer(scope: Scope) -> str | None:
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").decode(
        "latin-1").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


class DynsteerMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = getattr(getattr(scope.get("app"), "state", None), "dynsteer", None)
        if server is None:
            await self._handle(scope, receive, send, None)
            return
        with acting_as(client(_bearer(scope), server.api_keys)):
            await self._handle(scope, receive, send, server)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, server: Any) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope["method"]
        if method not in BODY_METHODS:
            if path == "/metrics" and method == "GET" and server is not None:
                await server.refresh_stats()
            await self.app(scope, receive, send)
            return
        ours = path.startswith(PREFIX)
        if ours:
            limit, setting = self.max_body_bytes, f"{MAX_BODY_ENV} / --dynsteer-max-body-bytes"
        else:
            limit = self.max_request_bytes
            setting = f"{MAX_REQUEST_ENV} / --dynsteer-max-request-bytes"
        too_large = _error(413, f"body: larger than {limit} bytes (raise {setting})")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await too_large(scope, receive, send)
            return
        try:
            body = await _read_body(receive, limit)
        except BodyTooLarge:
            await too_large(scope, receive, send)
            return
        if not ours and method == "POST":
            try:
                checked = check_body(path, body, server.frontend if server else None)
            except ValueError as e:
                await _error(400, str(e))(scope, receive, send)
                return
            if checked.body is not body:
                scope, body = _with_length(scope, len(checked.body)), checked.body
            if checked.captures:
                gzip = b"gzip" in dict(scope["headers"]).get(b"accept-encoding", b"")
                send = with_activations(send, server, path.rstrip("/"), checked.sink,
                                        checked.streamed, checked.live, checked.n, gzip)
        await self.app(scope, _replay(body, receive), send)
