"""Example asynchronous controllers, usable as they are:

    dynsteer controller run dynsteer.controller.examples:SessionGuard \\
        --events tcp://127.0.0.1:5557 --commands tcp://127.0.0.1:5558 \\
        --config '{"steer": [{"vector": "calm", "layers": [12], "scale": 4.0}]}'
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .async_controller import AsyncController
from .spec import MAX_ENTRIES, SteerEntry
from .zmq_protocol import Event, Monitor, RequestFinished, RequestStarted, SetSession

logger = logging.getLogger("dynsteer.controller")


class SessionGuardParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steer: list[SteerEntry] = Field(min_length=1, max_length=MAX_ENTRIES)
    """Steering added to the session's later requests."""
    min_gated: int = Field(default=1, ge=1)
    """Gated tokens (prompt and generated) of one request that trigger it."""
    api_key: str | None = None
    """The tenant's API key, when the server has keys (sessions are namespaced by it)."""


class SessionGuard(AsyncController):
    """Steers the rest of a session after a probe fires in one of its requests.

    A request's gate only steers that request's own tokens; once a probe has fired in a
    conversation, its later turns are likely to need steering too, from their first token on.
    When a request of a session finishes with at least ``min_gated`` gated tokens, the guard
    sets ``steer`` on the session (``SetSession``), once per session. A refused or unanswered
    command is logged and tried again on the session's next trigger.
    """

    def __init__(self, steer: list[dict[str, Any]], min_gated: int = 1,
                 api_key: str | None = None) -> None:
        super().__init__()
        self.params = SessionGuardParams(steer=steer, min_gated=min_gated, api_key=api_key)
        self.steered: set[str] = set()
        """Sessions the engine confirmed steering for."""

    def on_request_finished(self, event: RequestFinished) -> None:
        session, report = event.session, event.telemetry
        if session is None or report is None or session in self.steered:
            return
        if report.get("gated_prefill", 0) + report.get("gated_decode", 0) < self.params.min_gated:
            return
        try:
            reply = self.command(SetSession(session=session, steer=self.params.steer,
                                            api_key=self.params.api_key))
        except TimeoutError as e:
            logger.warning("session %s not steered: %s", session, e)
            return
        if not reply.ok:
            logger.warning("session %s not steered: %s", session, reply.error)
            return
        self.steered.add(session)
        logger.info("session %s steered after request %s", session, event.request_id)


class Recorder(AsyncController):
    """Keeps every event (and every gap) it is told about, in order: for tests, and for looking
    at what an engine publishes."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.gaps: list[int] = []
        """``missed`` of each :meth:`on_gap` call."""

    def on_request_started(self, event: RequestStarted) -> None:
        self.events.append(event)

    def on_monitor(self, event: Monitor) -> None:
        self.events.append(event)

    def on_request_finished(self, event: RequestFinished) -> None:
        self.events.append(event)

    def on_gap(self, missed: int) -> None:
        self.gaps.append(missed)
