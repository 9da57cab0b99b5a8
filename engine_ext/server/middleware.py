"""One pure-ASGI middleware for what routes cannot do themselves.

* ``POST /v1/chat/completions`` and ``/v1/completions`` with a top-level ``dynsteer`` object
  (OpenAI clients' ``extra_body``): the object moves into ``vllm_xargs["dynsteer"]`` as JSON,
  the path vLLM already carries into ``SamplingParams.extra_args``, so both ways of passing a
  spec meet the same validation. Every other POST with a top-level ``dynsteer`` object is HTTP
  400 naming the routes that take it (vLLM would ignore the unknown field and answer
  unsteered). Bodies without the ``"dynsteer"`` bytes pass untouched (one byte search); bodies
  with them are first checked to nest at most ``MAX_JSON_DEPTH`` levels (HTTP 400 above).
* Request bodies are capped before anything parses them (HTTP 413, from Content-Length, then
  while reading): ``max_body_bytes`` on ``/v1/dynsteer/`` routes, ``max_request_bytes`` on
  every other POST, PUT and PATCH (vLLM's routes, completions included).
* Completion bodies with a spec are checked as admission will check them (HTTP 400 naming the
  field), before vLLM answers: a streaming request gets its 400, not an error event in a 200
  stream. ``vllm_xargs`` keys reserved for dynsteer's internals (``dynsteer_*``) are refused.
* With API keys configured, a spec's ``session`` becomes the caller's namespace of it
  (:func:`.sessions.namespaced` of the bearer token), the same one its controller commands
  reach; without a configured key, the anonymous namespace (:func:`.sessions.anonymous`).
* ``GET /metrics`` first refreshes the workers' counters, so a scrape sees current values.

Error bodies carry our message only, in vLLM's ``{"error": {...}}`` shape.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynsteer.controller.contract import SPEC_KEY, SpecError
from dynsteer.controller.spec import MAX_JSON_DEPTH, check_json_depth

from ..frontend import admission
from ..frontend.admission import FrontendState
from .routes import PREFIX
from .sessions import anonymous, namespaced
from .settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_BODY_ENV,
    MAX_REQUEST_ENV,
)

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
"""The routes that take a spec (top-level ``dynsteer`` or ``vllm_xargs["dynsteer"]``)."""
BODY_METHODS = ("POST", "PUT", "PATCH")
_MARKER = f'"{SPEC_KEY}"'.encode()
_RESERVED_MARKER = f'"{SPEC_KEY}'.encode()
"""In every body with a spec or a reserved ``vllm_xargs`` key (others pass unparsed)."""
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


def _with_spec(body: bytes) -> _Json | None:
    """The body's JSON object when it has a top-level ``dynsteer`` key, else None.

    Raises :class:`SpecError` (a ValueError) when a body carrying the ``"dynsteer"`` bytes
    nests deeper than ``MAX_JSON_DEPTH``. Anything not a JSON object is None (vLLM reports it).
    """
    if _MARKER not in body:
        return None
    found = _json_object(body)
    return found if found is not None and SPEC_KEY in found.data else None


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


def _move_into_xargs(found: _Json) -> bool:
    """Move a top-level spec into ``vllm_xargs`` (in place); False when there is none to move
    or ``vllm_xargs`` is not an object (vLLM reports that)."""
    data = found.data
    if SPEC_KEY not in data:
        return False
    xargs = data.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return False
    if SPEC_KEY in xargs:
        raise ValueError(f"{SPEC_KEY}: given both as a top-level field and in vllm_xargs; "
                         "give it once")
    spec = data.pop(SPEC_KEY)
    xargs[SPEC_KEY] = spec if isinstance(spec, str) else found.dumps(spec).decode()
    data["vllm_xargs"] = xargs
    return True


def _moved(body: bytes, found: _Json) -> bytes:
    return found.dumps(found.data) if _move_into_xargs(found) else body


def move_spec_to_xargs(body: bytes) -> bytes:
    """The body with a top-level ``dynsteer`` object moved to ``vllm_xargs["dynsteer"]``.

    Raises ValueError when the spec is given both ways, or nests too deep. Anything not a
    JSON object is returned unchanged (vLLM reports it).
    """
    found = _with_spec(body)
    return body if found is None else _moved(body, found)


def rewrite_body(path: str, body: bytes) -> bytes:
    """``body`` as the app should see it on ``POST path`` (outside ``/v1/dynsteer/``).

    Completion routes get the spec moved into ``vllm_xargs``; on any other route a top-level
    ``dynsteer`` key is a ValueError naming the supported routes.
    """
    found = _with_spec(body)
    if found is None:
        return body
    if path.rstrip("/") in COMPLETION_PATHS:
        return _moved(body, found)
    raise SpecError(f"{SPEC_KEY}: not supported on {path}; send steered requests to "
                    f"{' or '.join(COMPLETION_PATHS)} (top-level \"{SPEC_KEY}\" or vllm_xargs)")


RESERVED_PREFIX = f"{SPEC_KEY}_"
"""``vllm_xargs`` keys starting with it are dynsteer's own (resolved spec, prefix-cache guard,
row claims, capture, ...): only the frontend sets them, never a client."""


def check_completion(body: bytes, frontend: FrontendState,
                     namespace: Callable[[str], str] | None = None) -> bytes:
    """A completion body as admission will see it (a top-level spec moved into
    ``vllm_xargs``), refused (ValueError naming the field) where admission would refuse it:
    before vLLM starts a 200 stream, so a streaming request with a bad spec gets its 400 too.
    The body is parsed once and written again only when something changed.

    ``vllm_xargs`` keys reserved for dynsteer are refused (the frontend would overwrite most;
    ``dynsteer_capture`` would join an open capture pass). ``namespace`` puts the spec's
    ``session`` in the caller's namespace (:func:`.sessions.namespaced` of its key,
    :func:`.sessions.anonymous`); None (no keys configured) leaves it as given."""
    found = _json_object(body)
    if found is None:
        return body
    changed = _move_into_xargs(found)
    xargs = found.data.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return body
    reserved = sorted(k for k in xargs if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
    if reserved:
        raise SpecError(f"vllm_xargs.{reserved[0]}: reserved for dynsteer's own use; a "
                        f"steering spec goes in vllm_xargs.{SPEC_KEY} or a top-level "
                        f"{SPEC_KEY!r} object")
    if SPEC_KEY in xargs:
        if namespace is not None:
            changed = _namespace_session(xargs, namespace, found.dumps) or changed
        admission.precheck(frontend, xargs)
    return found.dumps(found.data) if changed else body


def _namespace_session(xargs: dict[str, Any], namespace: Callable[[str], str],
                       dumps: Callable[[Any], bytes]) -> bool:
    """Put the spec's session (if any) in ``namespace``, in place; whether it had one. A spec
    given as an object is written back by ``dumps``, the encoder of the body it came in."""
    raw = xargs[SPEC_KEY]
    try:
        found = _loads(raw) if isinstance(raw, str) else _Json(raw, dumps)
    except (ValueError, RecursionError):
        return False  # admission names the field
    spec = found.data
    if not isinstance(spec, dict) or not isinstance(spec.get("session"), str):
        return False
    spec["session"] = namespace(spec["session"])
    xargs[SPEC_KEY] = found.dumps(spec).decode()
    return True


def _namespace_of(server: Any, scope: Scope) -> Callable[[str], str] | None:
    """The session namespace of the caller (None: no API keys configured)."""
    if not server.api_keys:
        return None
    key = _bearer(scope)
    return functools.partial(namespaced, api_key=key) if key in server.api_keys else anonymous


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
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope["method"]
        if method not in BODY_METHODS:
            if path == "/metrics" and method == "GET":
                server = getattr(scope["app"].state, "dynsteer", None)
                if server is not None:
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
            server = getattr(getattr(scope.get("app"), "state", None), "dynsteer", None)
            try:
                if (server is not None and _RESERVED_MARKER in body
                        and path.rstrip("/") in COMPLETION_PATHS):
                    new_body = check_completion(body, server.frontend,
                                                _namespace_of(server, scope))
                else:
                    new_body = rewrite_body(path, body)
            except ValueError as e:
                await _error(400, str(e))(scope, receive, send)
                return
            if new_body is not body:
                scope, body = _with_length(scope, len(new_body)), new_body
        await self.app(scope, _replay(body, receive), send)
