"""``server/disconnect.py``: a route's work is cancelled when its client disconnects first,
and returns as usual otherwise (no engine: a fake request)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException

from dynsteer.engine_ext.server.disconnect import CLIENT_CLOSED, unless_disconnected


class FakeRequest:
    method, url = "POST", type("Url", (), {"path": "/v1/dynsteer/capture"})()

    def __init__(self, gone_after: float | None) -> None:
        self.gone_after = gone_after

    async def receive(self) -> dict:
        if self.gone_after is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(self.gone_after)
        return {"type": "http.disconnect"}


def test_the_work_is_cancelled_when_the_client_leaves_first():
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    async def scenario() -> None:
        with pytest.raises(HTTPException) as raised:
            await unless_disconnected(FakeRequest(0.05), work())
        assert raised.value.status_code == CLIENT_CLOSED
        assert cancelled.is_set()

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_the_work_returns_while_the_client_stays():
    async def work() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async def scenario() -> str:
        return await unless_disconnected(FakeRequest(None), work())

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == "done"
