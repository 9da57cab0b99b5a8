"""Asynchronous controllers: Python code outside the engine that reacts to its events.

A controller subclasses :class:`AsyncController` and overrides the handlers it needs; a
:class:`ControllerLoop` connects it to an engine's two ZeroMQ sockets (see
:mod:`.zmq_protocol`): it receives the events on a SUB socket and calls the handlers, and the
handlers answer with :meth:`AsyncController.command` over a DEALER socket (``SetSession``,
``SetGlobal``, ...). Unlike the synchronous controllers of :mod:`.controllers`, these see
requests only through events and act with a delay (the event's trip plus the command's), and in
exchange run anywhere, in any process, without touching the engine's step.

    class Logger(AsyncController):
        def on_request_finished(self, event):
            print(event.request_id, event.telemetry)

    with ControllerLoop(Logger(), events="tcp://127.0.0.1:5557") as loop:
        loop.run()

or, from the shell, ``dynsteer controller run mymodule:Logger --events tcp://127.0.0.1:5557``
(:func:`main`). No vLLM import: pyzmq, msgspec and pydantic only.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import zmq
import zmq.auth
from pydantic import BaseModel, ConfigDict, Field

from .zmq_protocol import (
    EVENT_TYPES,
    Command,
    Event,
    Monitor,
    Reply,
    RequestFinished,
    RequestStarted,
    decode_event,
    encode,
)

logger = logging.getLogger("dynsteer.controller")

COMMAND_TIMEOUT = 5.0
"""Seconds :meth:`AsyncController.command` waits for a reply by default."""

EVENT_HWM = 10_000
"""Events the SUB socket queues while handlers are busy; beyond it ZeroMQ drops them (the
``seq`` gap then tells the controller) instead of growing without bound."""

RECONNECT_MS, RECONNECT_MAX_MS = 100, 5_000
"""First and largest reconnect interval: a restarted engine is picked up again within a few
seconds, and a long-gone one is not hammered."""

HEARTBEAT_MS = 2_000
"""ZMTP heartbeats: a peer that vanished without closing its TCP connection (a host gone, a
network cut) is noticed after three missed beats and reconnected to."""

POLL_MS = 100
"""How often :meth:`ControllerLoop.run` checks its stop event while no event arrives."""

Z85Key = Annotated[str, Field(min_length=40, max_length=40)]
"""A CURVE key in Z85 text (40 characters), as ``zmq.auth`` certificates hold them."""


@dataclass
class ControllerStats:
    """Counts of one controller's traffic, for logs and health checks."""

    events: int = 0
    """Events decoded and handed to a handler."""
    gaps: int = 0
    """Events missed in total (seq jumps; see :meth:`AsyncController.on_gap`)."""
    commands: int = 0
    """Commands sent."""
    command_errors: int = 0
    """Commands refused by the engine (``ok`` false) or not answered in time."""
    malformed: int = 0
    """Event messages that did not decode (skipped)."""
    handler_errors: int = 0
    """Handler calls that raised (logged; the loop goes on with the next event)."""


class CurveClient(BaseModel):
    """The keys of a CURVE-encrypted, authenticated connection to an engine: the engine's
    public key (so the client knows it talks to the real engine) and the client's own key pair
    (which the engine must have listed as allowed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server_public: Z85Key
    public: Z85Key
    secret: Z85Key

    @classmethod
    def from_certificates(cls, server_cert: str | os.PathLike[str],
                          client_cert: str | os.PathLike[str]) -> CurveClient:
        """Keys from ``zmq.auth.create_certificates`` files: the server's public certificate
        (``server.key``) and the client's secret one (``client.key_secret``). OSError or
        ValueError naming the file when one is missing or lacks a key."""
        server_public, _ = zmq.auth.load_certificate(server_cert)
        public, secret = zmq.auth.load_certificate(client_cert)
        if secret is None:
            raise ValueError(f"{client_cert} holds no secret key (give the .key_secret file)")
        return cls(server_public=server_public.decode(), public=public.decode(),
                   secret=secret.decode())

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE client of the engine (before it connects)."""
        socket.curve_serverkey = self.server_public.encode()
        socket.curve_publickey = self.public.encode()
        socket.curve_secretkey = self.secret.encode()


class AsyncController:
    """Base class of asynchronous controllers; override the handlers you need.

    Handlers run one at a time on the thread of the :class:`ControllerLoop` that feeds the
    controller, and may call :meth:`command` there. A handler that raises is logged and counted
    (:attr:`ControllerStats.handler_errors`); the next event is handled as usual, so one bad
    event does not stop a long-running controller. Subclasses with their own ``__init__`` must
    call ``super().__init__()``.
    """

    def __init__(self) -> None:
        self.stats = ControllerStats()
        self._channel: _CommandChannel | None = None
        self._ids = itertools.count(1)

    def on_request_started(self, event: RequestStarted) -> None:
        """A request was admitted to the engine."""

    def on_monitor(self, event: Monitor) -> None:
        """Monitor summaries of the gated requests of the last few steps."""

    def on_request_finished(self, event: RequestFinished) -> None:
        """A request finished; ``event.telemetry`` is its gate report (None: no gate)."""

    def on_gap(self, missed: int) -> None:
        """``missed`` events were lost before the one about to be handled (the engine's queue
        or this controller's high-water mark overflowed): state built from events may be
        incomplete. Called only when the loop receives every event type (no topic filter),
        since a filter makes seq jumps normal."""

    def command(self, cmd: Command, timeout: float = COMMAND_TIMEOUT) -> Reply:
        """Send one command (e.g. ``SetSession(session="s", steer=[...])``) and return the
        engine's reply; check ``reply.ok``. An empty ``id`` is filled from a counter (the
        reply is matched by it). TimeoutError naming the address when no reply comes within
        ``timeout`` seconds. Call it only from the loop's thread (ZeroMQ sockets are not
        thread-safe), i.e. from a handler or while the loop does not run."""
        if self._channel is None:
            raise RuntimeError(f"{type(self).__name__} has no commands socket: give the loop a "
                               "commands address")
        if not cmd.id:
            cmd = cmd.model_copy(update={"id": str(next(self._ids))})
        self.stats.commands += 1
        try:
            reply = self._channel.request(cmd, timeout)
        except TimeoutError:
            self.stats.command_errors += 1
            raise
        if not reply.ok:
            self.stats.command_errors += 1
        return reply


class _CommandChannel:
    """The DEALER socket a controller's commands go out on, one at a time."""

    def __init__(self, socket: zmq.Socket, address: str) -> None:
        self.socket = socket
        self.address = address

    def request(self, cmd: Command, timeout: float) -> Reply:
        """Send ``cmd`` and wait for the reply with its id; replies with other ids are left
        from earlier commands that timed out, and are skipped."""
        deadline = time.monotonic() + timeout
        # IMMEDIATE is set: writable only once the engine is connected, so a command is never
        # queued for an engine that is down and delivered long after its caller gave up.
        if not self.socket.poll(_ms_until(deadline), zmq.POLLOUT):
            raise TimeoutError(f"not connected to the engine's commands socket at "
                               f"{self.address} within {timeout:g} s")
        try:
            self.socket.send(encode(cmd), zmq.NOBLOCK)
        except zmq.Again:  # the engine went away between the poll and the send
            raise TimeoutError(f"lost the connection to {self.address}") from None
        while time.monotonic() < deadline:
            if not self.socket.poll(_ms_until(deadline), zmq.POLLIN):
                break
            frame = self.socket.recv()
            try:
                reply = Reply.model_validate(msgspec.msgpack.decode(frame))
            except ValueError as e:  # msgspec.DecodeError, ValidationError: both ValueErrors
                logger.warning("malformed reply from %s skipped: %s", self.address, e)
                continue
            if reply.id == cmd.id:
                return reply
            logger.debug("stale reply %r from %s skipped", reply.id, self.address)
        raise TimeoutError(f"no reply to {cmd.type} (id {cmd.id}) from {self.address} within "
                           f"{timeout:g} s")


def _ms_until(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _check_topics(topics: tuple[str, ...]) -> tuple[str, ...]:
    """``topics`` if each is an event type (a typo would silently subscribe to nothing)."""
    unknown = [t for t in topics if t not in EVENT_TYPES]
    if unknown:
        raise ValueError(f"unknown event type(s) {', '.join(unknown)}; known: "
                         f"{', '.join(EVENT_TYPES)}")
    return topics


class ControllerLoop:
    """Feeds one controller from an engine: a SUB socket for ``events`` (only the ``topics``
    given; all when empty) and, with a ``commands`` address, a DEALER socket for its commands.

    ZeroMQ sockets are not thread-safe: create the loop, :meth:`run` it and :meth:`close` it on
    one thread (or hand it over to another thread between calls, never share it). Both sockets
    reconnect by themselves, so a restarted engine is picked up again (its ``seq`` starting
    over is not a gap).
    """

    def __init__(self, controller: AsyncController, events: str, commands: str | None = None,
                 curve: CurveClient | None = None, topics: tuple[str, ...] = ()) -> None:
        if not hasattr(controller, "stats"):
            raise TypeError(f"{type(controller).__name__}.__init__ must call "
                            "super().__init__()")
        self.controller = controller
        _check_topics(topics)
        self._track_gaps = not topics or set(topics) >= set(EVENT_TYPES)
        self._next_seq: int | None = None
        self._context = zmq.Context()
        self._events = self._socket(zmq.SUB, curve)
        self._events.rcvhwm = EVENT_HWM
        for topic in topics or ("",):
            self._events.subscribe(topic)
        self._events.connect(events)
        if commands is not None:
            dealer = self._socket(zmq.DEALER, curve)
            dealer.immediate = True
            dealer.connect(commands)
            controller._channel = _CommandChannel(dealer, commands)

    def _socket(self, kind: int, curve: CurveClient | None) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.linger = 0  # close() never waits for an engine that is gone
        socket.reconnect_ivl = RECONNECT_MS
        socket.reconnect_ivl_max = RECONNECT_MAX_MS
        socket.heartbeat_ivl = HEARTBEAT_MS
        socket.heartbeat_timeout = 3 * HEARTBEAT_MS
        if curve is not None:
            curve.apply(socket)
        return socket

    def run(self, stop: threading.Event | None = None, max_events: int | None = None) -> None:
        """Handle events until ``stop`` is set or ``max_events`` events were handled
        (malformed ones do not count); forever without either."""
        handled = 0
        while max_events is None or handled < max_events:
            if stop is not None and stop.is_set():
                return
            if self._events.poll(POLL_MS) and self._handle(self._events.recv_multipart()):
                handled += 1

    def _handle(self, frames: list[bytes]) -> bool:
        """Decode one event message and call its handlers; False when it was malformed."""
        stats = self.controller.stats
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames, not [topic, payload]")
            event = decode_event(*frames)
        except ValueError as e:  # msgspec.DecodeError, ValidationError: both ValueErrors
            stats.malformed += 1
            logger.warning("malformed event skipped (%d so far): %s", stats.malformed, e)
            return False
        stats.events += 1
        missed = self._missed(event.seq)
        if missed:
            stats.gaps += missed
            self._call("on_gap", missed)
        self._call(f"on_{event.type}", event)  # on_request_started, on_monitor, ...
        return True

    def _missed(self, seq: int) -> int:
        """Events lost before the one numbered ``seq``."""
        expected, self._next_seq = self._next_seq, seq + 1
        if not self._track_gaps or expected is None:
            return 0
        if seq < expected:
            logger.info("event seq went back from %d to %d: the engine restarted",
                        expected - 1, seq)
            return 0
        return seq - expected

    def _call(self, handler: str, arg: Event | int) -> None:
        try:
            getattr(self.controller, handler)(arg)
        except Exception:
            self.controller.stats.handler_errors += 1
            logger.exception("%s.%s failed", type(self.controller).__name__, handler)

    def close(self) -> None:
        """Close both sockets (pending messages are dropped) and detach the controller."""
        self._context.destroy(linger=0)  # first: it closes the sockets the channel holds
        self.controller._channel = None

    def __enter__(self) -> ControllerLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- command line: dynsteer controller run ---------------------------------------------
_ENDPOINT = re.compile(r"(tcp://\S+:\d+|ipc://\S+|inproc://\S+)")


def _endpoint(text: str) -> str:
    if not _ENDPOINT.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a ZeroMQ address to connect to (tcp://HOST:PORT, ipc://PATH)")
    return text


def _json_object(text: str) -> dict[str, Any]:
    """``--config``: a JSON object, or ``@path`` of a file holding one."""
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        value = json.loads(text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object (the controller's keyword "
                                         "arguments)")
    return value


def _topic_list(text: str) -> tuple[str, ...]:
    try:
        return _check_topics(tuple(t.strip() for t in text.split(",") if t.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynsteer controller run",
        description="Run an asynchronous controller (an AsyncController subclass) against a "
                    "dynsteer engine's event and command sockets, until Ctrl-C or SIGTERM.")
    parser.add_argument("controller", metavar="MODULE:CLASS",
                        help="the controller class, e.g. dynsteer.controller.examples:"
                             "SessionGuard (the current folder is importable)")
    parser.add_argument("--events", required=True, type=_endpoint, metavar="ADDRESS",
                        help="the engine's events (PUB) address")
    parser.add_argument("--commands", type=_endpoint, metavar="ADDRESS",
                        help="the engine's commands (ROUTER) address; without it the "
                             "controller cannot send commands")
    parser.add_argument("--config", type=_json_object, default={}, metavar="JSON",
                        help="the controller's keyword arguments: a JSON object or @FILE")
    parser.add_argument("--server-key", type=Path, metavar="PATH",
                        help="the engine's public CURVE certificate (enables CURVE)")
    parser.add_argument("--client-key", type=Path, metavar="PATH",
                        help="this client's secret CURVE certificate")
    parser.add_argument("--topics", type=_topic_list, default=(), metavar="TYPES",
                        help=f"comma-separated event types to receive (default: all of "
                             f"{','.join(EVENT_TYPES)})")
    parser.add_argument("--max-events", type=_positive_int, metavar="N",
                        help="exit after handling this many events")
    return parser


def _controller_class(parser: argparse.ArgumentParser, target: str) -> type[AsyncController]:
    """The class ``module:Class`` names (exit 2 naming the argument when it cannot be had)."""
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        parser.error(f"argument MODULE:CLASS: {target!r} is not of the form module:Class")
    if os.getcwd() not in sys.path:  # the console script's sys.path lacks it, unlike python -m
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"argument MODULE:CLASS: cannot import {module_name!r}: {e}")
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, AsyncController)):
        parser.error(f"argument MODULE:CLASS: {target} is not an AsyncController subclass")
    return cls


def _curve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CurveClient | None:
    if args.server_key is None and args.client_key is None:
        return None
    if args.client_key is None:
        parser.error("argument --client-key: required with --server-key")
    if args.server_key is None:
        parser.error("argument --server-key: required with --client-key")
    try:
        return CurveClient.from_certificates(args.server_key, args.client_key)
    except (OSError, ValueError) as e:
        parser.error(f"argument --server-key/--client-key: {e}")


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM set ``stop``, so the loop ends between two events and closes its
    sockets, instead of a KeyboardInterrupt in the middle of a handler."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(s, lambda *_: stop.set()) for s in signals]
    try:
        yield
    finally:
        for s, handler in zip(signals, previous, strict=True):
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """``dynsteer controller run``; returns 0 on a clean stop, exits 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cls = _controller_class(parser, args.controller)
    curve = _curve(parser, args)
    try:
        controller = cls(**args.config)
    except (TypeError, ValueError) as e:  # ValueError: pydantic's ValidationError
        parser.error(f"argument --config: {cls.__name__}: {e}")
    stop = threading.Event()
    with _stop_on_signals(stop), ControllerLoop(controller, args.events, args.commands, curve,
                                                args.topics) as loop:
        logger.info("%s: events from %s%s%s", cls.__name__, args.events,
                    f", commands to {args.commands}" if args.commands else "",
                    " (CURVE)" if curve else "")
        loop.run(stop, args.max_events)
    logger.info("%s stopped: %s", cls.__name__, controller.stats)
    return 0
