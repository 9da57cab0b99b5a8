"""Activations in a completion's response.

A non-streaming ``/v1/completions`` or ``/v1/chat/completions`` request whose spec has
``capture`` (the middleware knows it from the body it checked) gets, once vLLM has answered,
what each choice captured, under ``dynsteer.activations`` of the JSON: one entry per choice in
:func:`dynsteer.controller.activations.to_json`'s form, read back by
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


def with_activations(send: Send, server: Any, path: str, sink: str | None = None) -> Send:
    """``send`` that holds the response back until its body is complete, then sends it with
    the activations added, or written to ``sink`` (a response other than 200 passes as it
    is)."""
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


async def attach(body: bytes, server: Any, path: str, sink: str | None = None) -> bytes:
    """The response ``body`` with ``dynsteer.activations`` (as it was when it is not a
    completion's JSON). With ``sink``, each choice's rows go to that sink under its engine
    request id, and the response keeps its status and positions only (``"sink"`` names
    where the rows went)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return body
    choices = data.get("choices") or []
    caller = current(server.frontend.default_caller).namespace or "-"
    usage = data.get("usage") or {}
    found = []
    for choice in choices:
        index = choice.get("index", 0) if isinstance(choice, dict) else 0
        engine_id = data["id"] if path == CHAT_PATH else f"{data['id']}-{index}"
        computed = None
        if len(choices) == 1 and "prompt_tokens" in usage and "completion_tokens" in usage:
            computed = int(usage["prompt_tokens"]) + int(usage["completion_tokens"]) - 1
        try:
            replies = await server.rpc("dynsteer_collect_activations", engine_id, computed)
        except WorkerError as e:
            found.append({"status": "dropped", "detail": str(e), "dtype": "float32",
                          "positions": [], "sites": {}})
            continue
        activations = request_capture.merge(replies)
        if sink is None or activations is None:
            found.append(to_json(activations))
            continue
        written = activations.status in ("ok", "partial") and server.sinks[sink].write(
            engine_id, activations, {"caller": caller})
        found.append({**to_json(activations), "sites": {}, "sink": sink if written else None})
    data["dynsteer"] = {"activations": found}
    return json.dumps(data).encode()
