"""The rows of streamed completions as they are computed.

A streamed completion whose capture streams (:attr:`~dynsteer.controller.spec.CaptureSpec.
streams`) gets, between its chunks, ``dynsteer.activations`` events with the rows computed
since the last one (:mod:`.activations`). Reading them is a worker RPC that runs between engine
steps, so the streams do not each send one: a stream asks :class:`StreamRows` for its
requests' new rows, and one RPC reads those of every stream waiting, at most one every
:data:`TICK_S`. A stream does not wait for its rows before its next chunk: they follow it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dynsteer.controller.activations import Activations

from ..frontend import request_capture

logger = logging.getLogger("vllm.dynsteer.server")

TICK_S = 0.05
"""Seconds between two reads of the streams' rows (each pauses the engine between steps)."""

Rpc = Callable[..., Awaitable[list[Any]]]


class StreamRows:
    """Reads the new rows of the requests of every stream waiting, one RPC at a time."""

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc
        self._waiting: list[tuple[list[tuple[str, int]], asyncio.Future[Any]]] = []
        self._reader: asyncio.Task[None] | None = None
        self._last = float("-inf")

    async def read(self, requests: list[tuple[str, int]]) -> list[Activations | None]:
        """Per request ((engine request id, first position not yet sent)), its rows computed
        since, kept on the workers (None: its capture does not stream, or it has none)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Activations | None]] = loop.create_future()
        self._waiting.append((requests, future))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._serve())
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            await asyncio.sleep(max(0.0, self._last + TICK_S - loop.time()))
            batch = [(r, f) for r, f in self._waiting if not f.done()]
            self._waiting = []
            if not batch:
                continue
            flat = [(request_id, None, since) for requests, _ in batch
                    for request_id, since in requests]
            self._last = loop.time()
            try:
                found = await request_capture.collect_through(self._rpc, flat, keep=True)
            except Exception as e:  # the streams go on; their rows come with the last event
                logger.warning("dynsteer: reading streamed requests' rows failed: %s", e)
                found = [None] * len(flat)
            at = 0
            for requests, future in batch:
                if not future.done():
                    future.set_result(found[at:at + len(requests)])
                at += len(requests)
