"""One pure-ASGI middleware for what routes cannot do themselves.

* ``POST /v1/chat/completions`` and ``/v1/completions`` with a top-level ``dynsteer`` object
  (OpenAI clients' ``extra_body``): the object moves into ``vllm_xargs["dynsteer"]`` as JSON,
  the path vLLM already carries into ``SamplingParams.extra_args``, so both ways of passing a
  spec meet the same validation. Bodies without the ``"dynsteer"`` bytes pass untouched.
* Bodies of ``/v1/dynsteer/`` routes are capped (HTTP 413) before anything parses them.
* ``GET /metrics`` first refreshes the workers' counters, so a scrape sees current values.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynsteer.controller.spec import SPEC_KEY
from dynsteer.engine_ext.server.routes import PREFIX

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_MARKER = f'"{SPEC_KEY}"'.encode()


class BodyTooLarge(Exception):
    pass


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError",
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
    return b"".join(chunks)


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


def move_spec_to_xargs(body: bytes) -> bytes:
    """The body with a top-level ``dynsteer`` object moved to ``vllm_xargs["dynsteer"]``.

    Raises ValueError when the spec is given both ways. Anything not a JSON object is returned
    unchanged (vLLM reports it).
    """
    if _MARKER not in body:
        return body
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or SPEC_KEY not in data:
        return body
    spec = data.pop(SPEC_KEY)
    xargs = data.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return body
    if SPEC_KEY in xargs:
        raise ValueError(f"{SPEC_KEY}: given both as a top-level field and in vllm_xargs; "
                         "give it once")
    xargs[SPEC_KEY] = spec if isinstance(spec, str) else json.dumps(spec)
    data["vllm_xargs"] = xargs
    return json.dumps(data).encode()


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


class DynsteerMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope["method"]
        if path.startswith(PREFIX) and method in ("POST", "PUT", "PATCH"):
            await self._capped(scope, receive, send)
        elif path in COMPLETION_PATHS and method == "POST":
            await self._completion(scope, receive, send)
        else:
            if path == "/metrics" and method == "GET":
                server = getattr(scope["app"].state, "dynsteer", None)
                if server is not None:
                    await server.refresh_stats()
            await self.app(scope, receive, send)

    async def _capped(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        too_large = _error(413, f"body: larger than {limit} bytes (raise "
                                "DYNSTEER_MAX_BODY_BYTES / --dynsteer-max-body-bytes)")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await too_large(scope, receive, send)
            return
        try:
            body = await _read_body(receive, limit)
        except BodyTooLarge:
            await too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive, None)
        try:
            new_body = move_spec_to_xargs(body)
        except ValueError as e:
            await _error(400, str(e))(scope, receive, send)
            return
        if new_body is not body:
            scope = _with_length(scope, len(new_body))
        await self.app(scope, _replay(new_body, receive), send)
