"""Activations in a completion's response.

A ``/v1/completions`` or ``/v1/chat/completions`` request whose spec has ``capture`` (the
middleware knows it from the body it checked) gets, once vLLM has answered, what each choice
captured, under ``dynsteer.activations`` of the JSON: one entry per choice in
:func:`dynsteer.controller.activations.to_json`'s form with the choice's ``index``, read back
by :func:`dynsteer.controller.activations.activations_of`. A stream gets them in events of
their own, ``{"id", "object": "dynsteer.activations", "choices": [], "dynsteer"}``: one before
``data: [DONE]`` and, when its capture streams, one after each chunk whose rows were read by
then (:mod:`.stream_rows`), each with the positions computed since the last;
:func:`~dynsteer.controller.activations.activations_of_stream` joins them. The rows are
collected from the workers (and freed there) by each choice's engine request id: the
response's ``id`` on the chat route, ``<id>-<prompt>`` for the prompts of a completion, each
of ``n > 1`` completions a request of its own (:func:`engine_ids`). Only
the caller that sent the request receives them. A capture naming a sink sends the rows there
instead (the response keeps each choice's status and positions), with the namespace of the
caller's API key (``caller``: ``-`` without keys, ``-/`` for a request without a configured
key), so an operator can tell whose traffic each row is.
"""

from __future__ import annotations

import asyncio
import gzip as _gzip
import json
from typing import Any

from starlette.types import Message, Send

from dynsteer.controller.activations import Activations, to_json

from ..compat.frontend import child_request_id
from ..frontend import request_capture
from ..frontend.caller import current
from .runtime import WorkerError

CHAT_PATH = "/v1/chat/completions"
GZIP_LEVEL = 1
"""Compression of a response carrying activations, for a client that accepts gzip (as the
``openai`` client does): base64 rows shrink by about a quarter at the fastest level, which
is what an API server's CPU can afford for hundreds of megabytes."""


def with_activations(send: Send, server: Any, path: str, sink: str | None,
                     streamed: bool, live: bool = False, n: int = 1,
                     gzip: bool = False) -> Send:
    """``send`` that adds the request's activations to its response (a response other than
    200 passes as it is): a JSON response is held back until its body is complete; a stream
    passes through as it comes, and gets one more event before ``data: [DONE]``, and with
    ``live`` (its capture streams), one after each chunk whose rows were read by then (see
    :mod:`.stream_rows`). ``n``: completions per prompt. ``gzip``: the client accepts it, so
    a JSON response is compressed (:data:`GZIP_LEVEL`)."""
    if streamed:
        return _streamed(send, server, path, sink, live, n)
    return _whole(send, server, path, sink, n, gzip)


def _whole(send: Send, server: Any, path: str, sink: str | None, n: int, gzip: bool) -> Send:
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
        headers = [(k, v) for k, v in start.get("headers", [])
                   if k.lower() != b"content-length"]
        if start["status"] == 200:
            body = await attach(body, server, path, sink, n)
            if gzip and not any(k.lower() == b"content-encoding" for k, _ in headers):
                body = await asyncio.to_thread(_gzip.compress, body, GZIP_LEVEL)
                headers.append((b"content-encoding", b"gzip"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return buffered


_DONE = b"data: [DONE]"


def _streamed(send: Send, server: Any, path: str, sink: str | None, live: bool,
              n: int) -> Send:
    stream = _Stream(server, path, n)

    async def passing(message: Message) -> None:
        if message["type"] == "http.response.start":
            stream.ok = message["status"] == 200
        elif message["type"] == "http.response.body" and stream.ok:
            body = message.get("body", b"")
            stream.saw(body)
            if stream.response_id is not None and _DONE in body:
                before, _, after = body.partition(_DONE)
                before += await stream.rows(wait=True)
                found = await collect(server, path, sink, stream.response_id,
                                      list(stream.indices), {}, stream.since, n)
                body = before + _event(stream.response_id, found) + _DONE + after
            elif stream.response_id is not None and live and stream.indices:
                body = await stream.rows(wait=False) + body
                stream.read_next()
            message = {**message, "body": body}
        await send(message)

    return passing


class _Stream:
    """What a streamed response's wrapper knows: its id, its choices, and the rows being read
    for them (:mod:`.stream_rows`)."""

    def __init__(self, server: Any, path: str, n: int) -> None:
        self.server = server
        self.path = path
        self.n = n
        self.ok = False
        self.response_id: str | None = None
        self.indices: dict[int, None] = {}
        self.since: dict[int, int] = {}
        """Per choice: its first position not yet sent."""
        self._reading: tuple[asyncio.Task[list[Activations | None]], list[int]] | None = None

    def saw(self, body: bytes) -> None:
        """Note the response id and choice indices of a piece of the stream."""
        for event in _events(body):
            if isinstance(event.get("id"), str):
                self.response_id = self.response_id or event["id"]
            for choice in event.get("choices") or ():
                if isinstance(choice, dict):
                    self.indices[int(choice.get("index", 0))] = None

    def read_next(self) -> None:
        """Start reading the rows computed since the last read (unless a read is running)."""
        if self._reading is not None or self.response_id is None:
            return
        order = list(self.indices)
        ids = engine_ids(self.path, self.response_id, order, self.n)
        task = asyncio.ensure_future(self.server.stream_rows.read(
            [(i, self.since.get(index, 0)) for i, index in zip(ids, order, strict=True)]))
        self._reading = (task, order)

    async def rows(self, wait: bool) -> bytes:
        """The event of the last read's rows, once it is done (``wait``: wait for it); b""
        when it is not done or found no new rows."""
        if self._reading is None or not (wait or self._reading[0].done()):
            return b""
        task, order = self._reading
        self._reading = None
        found = await task
        for index, activations in zip(order, found, strict=True):
            if activations is not None and len(activations.positions):
                self.since[index] = int(activations.positions[-1]) + 1
        if not any(a is not None and len(a.positions) for a in found):
            return b""
        return _event(self.response_id, [_indexed(to_json(a), i)
                                         for i, a in zip(order, found, strict=True)])


def _event(response_id: str | None, found: list[dict[str, Any] | None]) -> bytes:
    event = {"id": response_id, "object": "dynsteer.activations", "choices": [],
             "dynsteer": {"activations": found}}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _indexed(found: dict[str, Any] | None, index: int) -> dict[str, Any] | None:
    return None if found is None else {**found, "index": index}


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


async def attach(body: bytes, server: Any, path: str, sink: str | None = None,
                 n: int = 1) -> bytes:
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
        data.get("usage") or {}, n=n)}
    return json.dumps(data).encode()


def engine_ids(path: str, response_id: str, indices: list[int], n: int = 1) -> list[str]:
    """The engine request id of each choice: the response's ``id`` on the chat route,
    ``<id>-<prompt>`` for the prompts of a completion; with ``n`` > 1 completions per prompt,
    choice ``index`` is completion ``index % n`` of prompt ``index // n``, a request of its
    own."""
    ids = []
    for index in indices:
        prompt, completion = divmod(index, n)
        request_id = response_id if path == CHAT_PATH else f"{response_id}-{prompt}"
        ids.append(request_id if n == 1 else child_request_id(request_id, completion))
    return ids


async def collect(server: Any, path: str, sink: str | None, response_id: str,
                  indices: list[int], usage: dict[str, Any],
                  since: dict[int, int] | None = None, n: int = 1
                  ) -> list[dict[str, Any] | None]:
    """Each choice's activations, collected from the workers (and freed there), in the JSON
    form with the choice's ``index``; with ``sink``, written there instead (each keeps its
    status and positions, and ``"sink"`` names where the rows went). ``usage`` (a single
    choice's token counts) bounds the positions to those of its tokens; ``since``: per choice,
    the first position not sent yet (a stream's)."""
    caller = current(server.frontend.default_caller).namespace or "-"
    ids = engine_ids(path, response_id, indices, n)
    since = since or {}
    computed = None
    if len(indices) == 1 and "prompt_tokens" in usage and "completion_tokens" in usage:
        computed = int(usage["prompt_tokens"]) + int(usage["completion_tokens"]) - 1
    try:
        collected = await request_capture.collect_through(server.rpc, [
            (engine_id, computed, since.get(index, 0))
            for engine_id, index in zip(ids, indices, strict=True)])
    except WorkerError as e:
        return [{"status": "dropped", "detail": str(e), "dtype": "float32", "positions": [],
                 "sites": {}, "index": index} for index in indices]
    found: list[dict[str, Any] | None] = []
    for engine_id, index, activations in zip(ids, indices, collected, strict=True):
        if sink is None or activations is None:
            found.append(_indexed(to_json(activations), index))
            continue
        if sink in server.sinks:
            written = activations.status in ("ok", "partial") and server.sinks[sink].write(
                engine_id, activations, {"caller": caller})
        else:  # an engine sink: the workers wrote the rows
            written = activations.status == "ok"
        found.append({**to_json(activations), "sites": {}, "sink": sink if written else None,
                      "index": index})
    return found
