"""Activations in a completion's response.

A ``/v1/completions`` or ``/v1/chat/completions`` request whose spec has ``capture`` (the
middleware knows it from the body it checked) gets, once vLLM has answered, what each choice
captured, under ``dynsteer.activations`` of the JSON (a stream: of one more event before
``data: [DONE]``, ``{"id", "object": "dynsteer.activations", "choices": [], "dynsteer"}``):
one entry per choice in :func:`dynsteer.controller.activations.to_json`'s form, read back by
:func:`dynsteer.controller.activations.activations_of`. The rows are collected from the
workers (and freed there) by each choice's engine request id: the response's ``id`` on the
chat route, ``<id>-<index>`` for the prompts of a completion. Only the caller that sent the
request receives them. A capture naming a sink sends the rows there instead (the response
keeps each choice's status and positions), with the namespace of the caller's API key
(``caller``: ``-`` without keys, ``-/`` for a request without a configured key), so an operator
can tell whose traffic each row is.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message, Send

from dynsteer.controller.activations import to_json

from ..frontend import request_capture
from ..frontend.caller import current
from .runtime import WorkerError

CHAT_PATH = "/v1/chat/completions"


def with_activations(send: Send, server: Any, path: str, sink: str | None,
                     streamed: bool) -> Send:
    """``send`` that adds the request's activations to its response (a response other than
    200 passes as it is): a JSON response is held back until its body is complete; a stream
    passes through as it comes, and gets one more event before ``data: [DONE]``."""
    return (_streamed if streamed else _whole)(send, server, path, sink)


def _whole(send: Send, server: Any, path: str, sink: str | None) -> Send:
    start: Message | None = None
    chunks: list[bytes] = []

    async def buffered(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        if start["status"] == 200:
            body = await attach(body, server, path, sink)
        headers = [(k, v) for k, v in start.get("headers", [])
                   if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return buffered


_DONE = b"data: [DONE]"


def _streamed(send: Send, server: Any, path: str, sink: str | None) -> Send:
    response_id: str | None = None
    indices: dict[int, None] = {}
    ok = False

    async def passing(message: Message) -> None:
        nonlocal response_id, ok
        if message["type"] == "http.response.start":
            ok = message["status"] == 200
        elif message["type"] == "http.response.body" and ok:
            body = message.get("body", b"")
            for event in _events(body):
                response_id = response_id or event.get("id")
                for choice in event.get("choices") or ():
                    if isinstance(choice, dict):
                        indices[int(choice.get("index", 0))] = None
            if _DONE in body and isinstance(response_id, str):
                found = await collect(server, path, sink, response_id, list(indices), {})
                event = {"id": response_id, "object": "dynsteer.activations", "choices": [],
                         "dynsteer": {"activations": found}}
                before, _, after = body.partition(_DONE)
                message = {**message, "body": before + b"data: " + json.dumps(event).encode()
                           + b"\n\n" + _DONE + after}
        await send(message)

    return passing


def _events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a piece of a server-sent event stream."""
    found = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(event, dict):
                found.append(event)
    return found


async def attach(body: bytes, server: Any, path: str, sink: str | None = None) -> bytes:
    """The response ``body`` with ``dynsteer.activations`` (as it was when it is not a
    completion's JSON)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return body
    choices = [c for c in data.get("choices") or () if isinstance(c, dict)]
    data["dynsteer"] = {"activations": await collect(
        server, path, sink, data["id"], [int(c.get("index", 0)) for c in choices],
        data.get("usage") or {})}
    return json.dumps(data).encode()


async def collect(server: Any, path: str, sink: str | None, response_id: str,
                  indices: list[int], usage: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Each choice's activations, collected from the workers (and freed there), in the JSON
    form; with ``sink``, written there instead (each keeps its status and positions, and
    ``"sink"`` names where the rows went). ``usage`` (a single choice's token counts) bounds
    the positions to those of its tokens."""
    caller = current(server.frontend.default_caller).namespace or "-"
    engine_ids = [response_id if path == CHAT_PATH else f"{response_id}-{index}"
                  for index in indices]
    computed = None
    if len(indices) == 1 and "prompt_tokens" in usage and "completion_tokens" in usage:
        computed = int(usage["prompt_tokens"]) + int(usage["completion_tokens"]) - 1
    try:
        replies = await request_capture.replies_async(server.rpc(
            "dynsteer_collect_activations", *request_capture.collect_args(
                [(engine_id, computed) for engine_id in engine_ids])))
    except WorkerError as e:
        return [{"status": "dropped", "detail": str(e), "dtype": "float32", "positions": [],
                 "sites": {}} for _ in engine_ids]
    found: list[dict[str, Any] | None] = []
    for engine_id, activations in zip(engine_ids, request_capture.merge(replies, len(engine_ids)),
                                      strict=True):
        if sink is None or activations is None:
            found.append(to_json(activations))
            continue
        written = activations.status in ("ok", "partial") and server.sinks[sink].write(
            engine_id, activations, {"caller": caller})
        found.append({**to_json(activations), "sites": {}, "sink": sink if written else None})
    return found
