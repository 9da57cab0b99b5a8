"""Work a route does for a client that stops when the client goes away.

A long route (a capture of many prompts) keeps the engine busy for its client alone; if the
client disconnects, finishing it wastes the engine and holds up whoever waits behind it (one
capture runs at a time). The request's ASGI ``receive`` says ``http.disconnect`` once the
client is gone (the body was read already), so the route's work runs as a task beside a
watcher of ``receive``, and the first to finish decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import HTTPException, Request

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

T = TypeVar("T")

CLIENT_CLOSED = 499
"""The status logged for a request its client abandoned (nginx's: no one reads it)."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled (and :data:`CLIENT_CLOSED` raised) when the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        logger.info("dynsteer: %s %s cancelled: the client disconnected", request.method,
                    request.url.path)
        raise HTTPException(CLIENT_CLOSED, "the client closed the request")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
