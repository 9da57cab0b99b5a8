"""Asynchronous controllers against a fake engine (the protocol's two sockets driven by the
test; no vLLM): event dispatch, seq gaps, malformed events, commands and their replies, the
SessionGuard example, CURVE, and the `dynsteer controller run` command line."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dynsteer.controller import async_controller
from dynsteer.controller.async_controller import AsyncController, ControllerLoop, CurveClient
from dynsteer.controller.examples import Recorder, SessionGuard
from dynsteer.controller.zmq_protocol import (
    ClearSession,
    Event,
    Monitor,
    Ping,
    Reply,
    RequestFinished,
    RequestStarted,
    SetSession,
    decode_command,
    encode,
)
from dynsteer.engine_ext import cli

STEER = [{"vector": "calm", "layers": [1], "scale": 2.0}]


class FakeEngine:
    """The engine's sockets: an XPUB (a PUB that also reports its subscribers, so a test
    publishes only once the controller listens) and a ROUTER a thread answers with
    ``respond(command) -> replies`` (None: never answers). ``keys``: CURVE server keys."""

    def __init__(self, respond: Callable[[object], list[Reply]] | None = None,
                 keys: tuple[bytes, bytes] | None = None,
                 context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context()
        self.pub = self._bind(zmq.XPUB, keys)
        self.router = self._bind(zmq.ROUTER, keys)
        self.events = self.pub.last_endpoint.decode()
        self.commands = self.router.last_endpoint.decode()
        self.received: list[object] = []
        self.respond = respond
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _bind(self, kind: int, keys: tuple[bytes, bytes] | None) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.linger = 0
        if keys is not None:
            socket.curve_publickey, socket.curve_secretkey = keys
            socket.curve_server = True
        socket.bind("tcp://127.0.0.1:*")
        return socket

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            peer, frame = self.router.recv_multipart()
            command = decode_command(frame)
            self.received.append(command)
            for reply in self.respond(command) if self.respond else ():
                self.router.send_multipart([peer, encode(reply)])

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "no subscriber"
        self.pub.recv()

    def publish(self, *events: Event) -> None:
        for event in events:
            self.pub.send_multipart([event.type.encode(), encode(event)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close()
        self.router.close()


@pytest.fixture
def engine():
    fake = FakeEngine(respond=lambda cmd: [Reply(id=cmd.id, ok=True)])
    yield fake
    fake.close()
    fake.context.term()


def started(seq: int) -> RequestStarted:
    return RequestStarted(seq=seq, time=0.0, request_id=f"r{seq}", session=None, static=False,
                          gated=True, controller=None)


def monitor(seq: int) -> Monitor:
    return Monitor(seq=seq, time=0.0, step=seq, steps=1, request_id=["r"], session=[None],
                   tokens=[4], gated=[1], max_score=[0.9])


def finished(seq: int, session: str | None = None, gated: int | None = 0) -> RequestFinished:
    telemetry = None if gated is None else {"gated_prefill": gated, "gated_decode": 0}
    return RequestFinished(seq=seq, time=0.0, request_id=f"r{seq}", session=session,
                           telemetry=telemetry)


def run(loop: ControllerLoop, max_events: int | None = None, seconds: float = 5.0) -> None:
    """Run the loop until ``max_events`` or ``seconds`` (a safety net, or the point)."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        loop.run(stop, max_events)
    finally:
        timer.cancel()


def test_events_reach_their_handlers(engine):
    recorder = Recorder()
    with ControllerLoop(recorder, engine.events) as loop:
        engine.wait_subscribed()
        engine.publish(started(7), monitor(8), finished(9, "s"))
        run(loop, max_events=3)
    assert [type(e) for e in recorder.events] == [RequestStarted, Monitor, RequestFinished]
    assert recorder.events[2].session == "s"
    assert recorder.gaps == []  # the first event seen (seq 7) is no gap
    assert recorder.stats.events == 3


def test_a_seq_gap_reports_the_missed_events(engine):
    recorder = Recorder()
    with ControllerLoop(recorder, engine.events) as loop:
        engine.wait_subscribed()
        # 2 and 3 lost; then the engine restarts (seq 0 again), which is no gap
        engine.publish(started(0), monitor(1), monitor(4), finished(5), started(0), monitor(1))
        run(loop, max_events=6)
    assert recorder.gaps == [2]
    assert recorder.stats.gaps == 2


def test_a_topic_filter_makes_seq_jumps_normal(engine):
    recorder = Recorder()
    with ControllerLoop(recorder, engine.events, topics=("request_finished",)) as loop:
        engine.wait_subscribed()
        engine.publish(finished(0), monitor(1), started(2), finished(3))
        run(loop, max_events=2)
    assert [e.seq for e in recorder.events] == [0, 3]
    assert recorder.gaps == []
    with pytest.raises(ValueError, match="monitr"):
        ControllerLoop(Recorder(), engine.events, topics=("monitr",))


def test_malformed_events_are_counted_and_skipped(engine):
    recorder = Recorder()
    wrong_version = msgspec.msgpack.encode({**started(1).model_dump(mode="json"), "v": 2})
    with ControllerLoop(recorder, engine.events) as loop:
        engine.wait_subscribed()
        engine.pub.send_multipart([b"monitor", b"\xc1 not msgpack"])
        engine.pub.send_multipart([b"no_such_event", encode(started(0))])
        engine.pub.send_multipart([b"request_started", wrong_version])
        engine.pub.send(b"one frame")
        engine.publish(started(2))
        run(loop, max_events=1)
    assert recorder.stats.malformed == 4
    assert [e.seq for e in recorder.events] == [2]


def test_a_handler_that_raises_does_not_stop_the_loop(engine):
    class Flaky(Recorder):
        def on_monitor(self, event: Monitor) -> None:
            raise RuntimeError("bug")

    flaky = Flaky()
    with ControllerLoop(flaky, engine.events) as loop:
        engine.wait_subscribed()
        engine.publish(monitor(0), started(1))
        run(loop, max_events=2)
    assert flaky.stats.handler_errors == 1
    assert [e.seq for e in flaky.events] == [1]


def test_a_subclass_must_initialise_its_base(engine):
    class Forgetful(AsyncController):
        def __init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="super"):
        ControllerLoop(Forgetful(), engine.events)


def test_command_round_trip_matches_replies_by_id(engine):
    def respond(cmd) -> list[Reply]:
        stale = Reply(id="stale", ok=True)  # left from an earlier command that timed out
        if isinstance(cmd, ClearSession):
            return [stale, Reply(id=cmd.id, ok=False, error="session: unknown")]
        return [stale, Reply(id=cmd.id, ok=True, result={"type": cmd.type})]

    engine.respond = respond
    controller = AsyncController()
    with ControllerLoop(controller, engine.events, engine.commands):
        reply = controller.command(Ping())
        assert (reply.id, reply.ok, reply.result) == ("1", True, {"type": "ping"})
        assert controller.command(Ping(id="mine")).id == "mine"
        refused = controller.command(ClearSession(session="s"))
        assert (refused.ok, refused.error) == (False, "session: unknown")
    assert [c.id for c in engine.received] == ["1", "mine", "2"]
    assert (controller.stats.commands, controller.stats.command_errors) == (3, 1)


def test_command_times_out_naming_the_address(engine):
    engine.respond = None  # receives, never answers
    controller = AsyncController()
    with ControllerLoop(controller, engine.events, engine.commands):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=engine.commands):
            controller.command(Ping(), timeout=0.2)
        assert time.monotonic() - start < 2
    nobody = "tcp://127.0.0.1:1"  # nothing listens: the command is never even queued
    with ControllerLoop(controller, engine.events, nobody), \
            pytest.raises(TimeoutError, match=nobody):
        controller.command(Ping(), timeout=0.2)
    assert controller.stats.command_errors == 2
    with ControllerLoop(controller, engine.events), pytest.raises(RuntimeError, match="commands"):
        controller.command(Ping())


def test_session_guard_steers_each_session_once(engine):
    refusals = {"retry": 1}  # the first SetSession of "retry" is refused

    def respond(cmd) -> list[Reply]:
        if refusals.get(cmd.session, 0):
            refusals[cmd.session] -= 1
            return [Reply(id=cmd.id, ok=False, error="busy")]
        return [Reply(id=cmd.id, ok=True)]

    engine.respond = respond
    guard = SessionGuard(steer=STEER, min_gated=2)
    events = [
        finished(0, "s1", gated=2),
        finished(1, "s1", gated=5),       # already steered
        finished(2, None, gated=9),       # no session
        finished(3, "s2", gated=None),    # no gate
        finished(4, "s3", gated=1),       # below min_gated
        finished(5, "retry", gated=3),    # refused ...
        finished(6, "retry", gated=3),    # ... tried again
        started(7), monitor(8),
    ]
    with ControllerLoop(guard, engine.events, engine.commands) as loop:
        engine.wait_subscribed()
        engine.publish(*events)
        run(loop, max_events=len(events))
    assert all(isinstance(c, SetSession) for c in engine.received)
    assert [c.session for c in engine.received] == ["s1", "retry", "retry"]
    assert [e.model_dump(exclude_defaults=True) for e in engine.received[0].steer] == STEER
    assert guard.steered == {"s1", "retry"}
    assert guard.stats.command_errors == 1


def test_session_guard_validates_its_parameters():
    with pytest.raises(ValueError, match="min_gated"):
        SessionGuard(steer=STEER, min_gated=0)
    with pytest.raises(ValueError, match="steer"):
        SessionGuard(steer=[])


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, Path]:
    """Key pairs of the engine, an allowed client and a stranger (each in its own folder, so
    the allowed folder holds the allowed client's public key only)."""
    paths = {}
    for name in ("server", "client", "stranger"):
        (tmp_path / name).mkdir()
        public, secret = zmq.auth.create_certificates(tmp_path / name, name)
        paths[name], paths[f"{name}_secret"] = Path(public), Path(secret)
    return paths


@pytest.fixture
def curve_engine(certificates):
    context = zmq.Context()
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(certificates["client"].parent))
    public, secret = zmq.auth.load_certificate(certificates["server_secret"])
    fake = FakeEngine(respond=lambda cmd: [Reply(id=cmd.id, ok=True)], keys=(public, secret),
                      context=context)
    yield fake
    fake.close()
    auth.stop()
    context.term()


def test_curve_with_the_right_keys(curve_engine, certificates):
    curve = CurveClient.from_certificates(certificates["server"], certificates["client_secret"])
    recorder = Recorder()
    with ControllerLoop(recorder, curve_engine.events, curve_engine.commands, curve) as loop:
        curve_engine.wait_subscribed()
        curve_engine.publish(started(0))
        run(loop, max_events=1)
        assert recorder.command(Ping(), timeout=2).ok
    assert len(recorder.events) == 1


@pytest.mark.parametrize("keys", ["none", "stranger"])
def test_curve_without_allowed_keys_gets_nothing(curve_engine, certificates, keys):
    curve = None if keys == "none" else CurveClient.from_certificates(
        certificates["server"], certificates["stranger_secret"])
    recorder = Recorder()
    with ControllerLoop(recorder, curve_engine.events, curve_engine.commands, curve) as loop:
        time.sleep(0.2)  # time enough for a handshake that would succeed
        curve_engine.publish(started(0), started(1))
        run(loop, seconds=0.3)
        with pytest.raises(TimeoutError):
            recorder.command(Ping(), timeout=0.2)
    assert recorder.events == [] and curve_engine.received == []


def test_curve_client_needs_the_secret_certificate(certificates):
    with pytest.raises(ValueError, match="secret"):
        CurveClient.from_certificates(certificates["server"], certificates["client"])


@pytest.mark.parametrize(("argv", "flag"), [
    (["dynsteer.controller.examples:Recorder"], "--events"),
    (["dynsteer.controller.examples:Recorder", "--events", "localhost:5"], "--events"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--commands", "tcp://127.0.0.1"], "--commands"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--config", "[1]"], "--config"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--config", "@/nonexistent.json"], "--config"),
    (["dynsteer.controller.examples:SessionGuard", "--events", "tcp://127.0.0.1:5",
      "--config", '{"steer": [], "min_gated": 1}'], "--config"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--topics", "monitor,bogus"], "--topics"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--max-events", "0"], "--max-events"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--server-key", "server.key"], "--client-key"),
    (["dynsteer.controller.examples:Recorder", "--events", "tcp://127.0.0.1:5",
      "--server-key", "/nonexistent.key", "--client-key", "/x.key_secret"], "--server-key"),
    (["dynsteer.controller.examples", "--events", "tcp://127.0.0.1:5"], "MODULE:CLASS"),
    (["no_such_module_here:C", "--events", "tcp://127.0.0.1:5"], "MODULE:CLASS"),
    (["dynsteer.controller.zmq_protocol:Reply", "--events", "tcp://127.0.0.1:5"],
     "MODULE:CLASS"),
])
def test_cli_argument_errors_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        async_controller.main(argv)
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_runs_until_max_events(engine):
    def publish() -> None:
        engine.wait_subscribed()
        engine.publish(started(0), finished(1))

    publisher = threading.Thread(target=publish)
    publisher.start()
    assert cli.main(["controller", "run", "dynsteer.controller.examples:Recorder",
                     "--events", engine.events, "--max-events", "2"]) == 0
    publisher.join()


def test_cli_stops_cleanly_on_sigterm(engine):
    def terminate() -> None:
        engine.wait_subscribed()  # the loop exists, so its signal handlers are installed
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate)
    killer.start()
    before = signal.getsignal(signal.SIGTERM)
    assert async_controller.main(["dynsteer.controller.examples:SessionGuard",
                                  "--events", engine.events, "--commands", engine.commands,
                                  "--config", json.dumps({"steer": STEER})]) == 0
    killer.join()
    assert signal.getsignal(signal.SIGTERM) is before
