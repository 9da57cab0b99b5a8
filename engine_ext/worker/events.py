"""Controller events out of the engine: a ZeroMQ PUB socket fed by a bounded queue.

The step path only appends a tuple to a queue (or counts a drop when it is full) and sets a
flag; a daemon thread encodes (msgpack, :mod:`dynsteer.controller.zmq_protocol`) and sends
without blocking. So a slow, crashed or absent subscriber never delays a step: events beyond
the queue (engine option ``events_queue``) or ZeroMQ's high-water mark are dropped and counted,
and the sequence number, assigned when an event is made, shows the subscriber the gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from dynsteer.controller.zmq_protocol import SCHEMA_VERSION

from ..zmq_security import bind

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])


class EventPublisher:
    """One PUB socket and its sender thread (see the module docstring)."""

    def __init__(self, address: str, queue_size: int) -> None:
        self.address = address
        self.published = 0
        self.dropped = 0
        self._seq = 0
        self._cap = queue_size
        self._queue: deque[tuple[bytes, dict[str, Any]]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="dynsteer-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, topic: str, fields: dict[str, Any]) -> None:
        """Queue one event (``fields`` without ``v``/``seq``/``time``); never blocks."""
        seq, self._seq = self._seq, self._seq + 1
        if len(self._queue) >= self._cap:
            self.dropped += 1
            return
        fields.update(v=SCHEMA_VERSION, seq=seq, time=time.time(), type=topic)
        self._queue.append((topic.encode(), fields))
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(5)

    def stats(self) -> dict[str, int]:
        return {"events_published": self.published, "events_dropped": self.dropped,
                "events_queued": len(self._queue)}

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, self._cap)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            auth = bind(socket, self.address, "dynsteer.events_address")
        except Exception as e:  # reported to the constructor
            self._error = e
            socket.close()
            self._ready.set()
            return
        self._ready.set()
        logger.info("dynsteer: publishing controller events on %s", self.address)
        encode = msgspec.msgpack.encode
        try:
            while not self._stop:
                self._wake.wait(0.5)
                self._wake.clear()
                while self._queue:
                    topic, fields = self._queue.popleft()
                    # PUB never blocks: past a subscriber's high-water mark ZeroMQ drops.
                    socket.send_multipart((topic, encode(fields)), zmq.NOBLOCK)
                    self.published += 1
        finally:
            socket.close()
            if auth is not None:
                auth.stop()
            context.term()


class EngineEvents:
    """The events of :mod:`dynsteer.controller.zmq_protocol`, made from the worker's state."""

    def __init__(self, publisher: EventPublisher, every: int) -> None:
        self.publisher = publisher
        self.every = every
        """Steps per monitor summary."""

    def request_started(self, req_id: str, wire: dict[str, Any] | None) -> None:
        controller = (wire or {}).get("controller")
        self.publisher.publish("request_started", {
            "request_id": req_id, "session": (wire or {}).get("session"),
            "static": bool(wire and wire["steer"]), "gated": bool(wire and wire["gate"]),
            "controller": controller["name"] if controller else None})

    def monitor(self, step: int, ids: list[str], sessions: list[str | None], tokens: Any,
                gated: Any, max_score: Any) -> None:
        """Summaries of the last :attr:`every` steps (numpy arrays parallel to ``ids``)."""
        scores = [None if s != s else s for s in max_score.tolist()]  # NaN: no score
        self.publisher.publish("monitor", {
            "step": step, "steps": self.every, "request_id": ids, "session": sessions,
            "tokens": tokens.tolist(), "gated": gated.tolist(), "max_score": scores})

    def request_finished(self, req_id: str, session: str | None,
                         telemetry: dict[str, Any] | None) -> None:
        self.publisher.publish("request_finished", {
            "request_id": req_id, "session": session, "telemetry": telemetry})
