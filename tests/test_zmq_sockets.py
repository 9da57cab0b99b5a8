"""The engine side of asynchronous controllers without an engine: the event publisher, the
command socket (on a real frontend state and control plane), CURVE, session steering."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from dynsteer.controller.zmq_protocol import (
    MAX_COMMAND_BYTES,
    Ping,
    Reply,
    SetSession,
    decode_event,
    encode,
)
from dynsteer.engine_ext.frontend.admission import FrontendState, admit
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.commands import CommandServer
from dynsteer.engine_ext.server.runtime import DynsteerServer
from dynsteer.engine_ext.server.sessions import client
from dynsteer.engine_ext.server.settings import ServerSettings
from dynsteer.engine_ext.worker.events import EventPublisher
from dynsteer.engine_ext.zmq_security import CLIENT_KEYS_ENV, SERVER_KEY_ENV, is_loopback

HIDDEN = 8
SITES = (("post_block", 0), ("post_block", 1))


def frontend() -> FrontendState:
    return FrontendState(options=EngineOptions(), hidden_size=HIDDEN, num_layers=2, sites=SITES)


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def subscriber(address: str, curve: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    if curve:
        sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = curve
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    return sub


def receive(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[bytes, bytes]] | None:
    if not sub.poll(timeout_ms):
        return None
    frames = []
    while sub.poll(50):
        frames.append(tuple(sub.recv_multipart()))
    return frames


def publish_until_seen(pub: EventPublisher, sub: zmq.Socket) -> list:
    """Publish until the subscriber is connected (ZeroMQ's slow joiner), then collect."""
    for _ in range(50):
        pub.publish("request_started", {"request_id": "warm", "session": None, "static": False,
                                        "gated": False, "controller": None})
        got = receive(sub, 100)
        if got:
            return got
    return []


def test_publisher_sends_versioned_events_with_sequence_numbers():
    address = free_address()
    pub = EventPublisher(address, queue_size=64)
    sub = subscriber(address)
    try:
        assert publish_until_seen(pub, sub)
        pub.publish("request_finished", {"request_id": "r1", "session": "s", "telemetry": None})
        ((topic, payload),) = receive(sub)
        event = decode_event(topic, payload)
        assert event.v == 1 and event.request_id == "r1" and event.session == "s"
        assert event.seq == pub.published - 1 + pub.dropped
    finally:
        sub.close()
        pub.close()


def test_a_full_queue_drops_and_counts_without_blocking():
    """No subscriber reads; a queue of 4 takes 4 events per wake-up, the rest are dropped and
    the sequence numbers show the gap."""
    address = free_address()
    pub = EventPublisher(address, queue_size=4)
    try:
        pub._wake.set = lambda: None  # hold the sender so the queue fills
        start = time.perf_counter()
        for i in range(100):
            pub.publish("request_finished", {"request_id": f"r{i}", "session": None,
                                             "telemetry": None})
        assert time.perf_counter() - start < 0.05
        assert pub.dropped == 96 and len(pub._queue) == 4
        assert [f["seq"] for _, f in pub._queue] == [0, 1, 2, 3]
    finally:
        pub.close()


def test_remote_addresses_need_curve_keys(monkeypatch):
    monkeypatch.delenv(SERVER_KEY_ENV, raising=False)
    assert is_loopback("tcp://127.0.0.1:5") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5") and not is_loopback("tcp://10.1.2.3:5")
    with pytest.raises(ValueError, match=r"^dynsteer.events_address: tcp://0.0.0.0:\d+ is "
                                         r"reachable from other machines"):
        EventPublisher("tcp://0.0.0.0:" + free_address().rsplit(":", 1)[1], 4)


@pytest.fixture
def curve(tmp_path, monkeypatch):
    """Server and client certificates; the server's env points at them."""
    clients = tmp_path / "clients"
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    shutil.copy(client_public, clients / "client.key")
    monkeypatch.setenv(SERVER_KEY_ENV, str(server_secret))
    monkeypatch.setenv(CLIENT_KEYS_ENV, str(clients))
    server_key, _ = zmq.auth.load_certificate(server_public)
    public, secret = zmq.auth.load_certificate(client_secret)
    stranger_public, stranger_secret = zmq.curve_keypair()
    return (server_key, public, secret), (server_key, stranger_public, stranger_secret)


def test_curve_events_reach_keyed_subscribers_only(curve):
    keyed, stranger = curve
    address = free_address()
    pub = EventPublisher(address, queue_size=64)
    good, bad, plain = subscriber(address, keyed), subscriber(address, stranger), \
        subscriber(address)
    try:
        assert publish_until_seen(pub, good)
        assert receive(bad, 300) is None and receive(plain, 300) is None
    finally:
        for s in (good, bad, plain):
            s.close()
        pub.close()


async def _command_round_trip(server: CommandServer, frames: list[bytes],
                              curve_keys: tuple[bytes, bytes, bytes] | None = None,
                              timeout_ms: int = 3000) -> list[Reply | None]:
    context = zmq.asyncio.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if curve_keys:
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = curve_keys
    dealer.connect(server.address)
    replies: list[Reply | None] = []
    try:
        for frame in frames:
            await dealer.send(frame)
            if await dealer.poll(timeout_ms):
                replies.append(Reply.model_validate(msgspec.msgpack.decode(await dealer.recv())))
            else:
                replies.append(None)
    finally:
        dealer.close()
    return replies


def run_commands(frames, curve_keys=None, api_keys=(), state=None, timeout_ms=3000):
    async def main():
        dyn = DynsteerServer(None, state or frontend(), ServerSettings(), list(api_keys), "m")
        server = CommandServer(dyn, free_address())
        server.start()
        try:
            return await _command_round_trip(server, frames, curve_keys, timeout_ms), server
        finally:
            await server.close()

    return asyncio.run(main())


def test_bad_frames_are_answered_and_counted():
    frames = [b"\xc1garbage", b"x" * (MAX_COMMAND_BYTES + 1),
              msgspec.msgpack.encode({"v": 2, "type": "ping"}),
              msgspec.msgpack.encode({"v": 1, "type": "launch_missiles"}),
              msgspec.msgpack.encode({"v": 1, "type": "set_session", "session": "bad name"}),
              msgspec.msgpack.encode([1, 2]),
              encode(Ping(id="p1"))]
    replies, server = run_commands(frames)
    assert [r.ok for r in replies] == [False] * 6 + [True]
    assert replies[2].error.startswith("v: schema version 2 is not supported")
    assert replies[4].error.startswith("session: String should match pattern")
    assert replies[-1].id == "p1" and replies[-1].result == "pong"
    assert server.rejected == {"malformed": 2, "oversized": 1, "version": 1, "invalid": 2}
    assert server.handled == {"ping": 1}


def test_session_steering_reaches_later_requests_of_that_session_only():
    state = frontend()
    vector = [0.5] * HIDDEN
    command = SetSession(id="s", session="conv-1",
                         steer=[{"vector": vector, "layers": [1]}])
    replies, _ = run_commands([encode(command)], state=state)
    assert replies[0].ok, replies[0].error
    _, steered = admit(state, {"dynsteer": {"session": "conv-1"}})
    _, other = admit(state, {"dynsteer": {"session": "conv-2"}})
    assert len(steered["steer"]) == 1 and other["steer"] == []
    assert steered["key"] != other["key"]
    assert np.allclose(np.frombuffer(steered["steer"][0][4], "<f4"), vector)


def test_api_keys_namespace_sessions_and_are_required():
    state = frontend()
    command = SetSession(session="c", steer=[{"vector": [1.0] * HIDDEN, "layers": [0]}])
    unkeyed = command.model_copy(update={"id": "no"})
    keyed = command.model_copy(update={"id": "yes", "api_key": "k1"})
    replies, server = run_commands([encode(unkeyed), encode(keyed)], api_keys=["k1", "k2"],
                                   state=state)
    assert not replies[0].ok and replies[0].error.startswith("api_key:")
    assert replies[1].ok
    assert server.rejected == {"unauthorized": 1}

    def namespaced(session: str, key: str) -> str:
        return client(key, [key]).session(session)

    assert list(state.sessions) == [namespaced("c", "k1")]
    assert namespaced("c", "k1") != namespaced("c", "k2")
    assert namespaced(namespaced("c", "k1"), "k1") == namespaced("c", "k1")  # as events show it
    assert namespaced(namespaced("c", "k2"), "k1") != namespaced("c", "k2")


def test_curve_commands_answer_keyed_clients_only(curve):
    keyed, stranger = curve
    replies, _ = run_commands([encode(Ping(id="a"))], curve_keys=keyed)
    assert replies[0].ok
    replies, server = run_commands([encode(Ping(id="b"))], curve_keys=stranger, timeout_ms=500)
    assert replies == [None] and server.handled == {}
    replies, server = run_commands([encode(Ping(id="c"))], timeout_ms=500)
    assert replies == [None] and server.handled == {}
