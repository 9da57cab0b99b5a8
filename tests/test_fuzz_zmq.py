"""Hostile frames on the controller command socket, and where dynsteer's ZeroMQ sockets may bind.

The command socket (a ROUTER on the API server's event loop) takes frames from any process
that can reach it, so every frame must get exactly one reply, be counted (handled by type, or
rejected by reason), and leave the loop answering the next one; and nothing in it may ever be
unpickled. Here one real :class:`CommandServer` runs on its own event loop over a real
frontend state and control plane (its engine answers every worker call, as in
``test_routes_unit``), and a DEALER sends it random bytes, truncated, oversized, wrong-version
and wrong-typed commands and multipart frames. No vLLM engine is started.

``test_zmq_sockets`` covers the basics (one bad frame of each kind, CURVE, session namespaces,
the event publisher's loopback check); this module adds the properties and the bind rules of
the command socket.
"""

from __future__ import annotations

import ast
import asyncio
import json
import pickle
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from fuzz_report import report_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_routes_unit import FakeEngine
from test_zmq_sockets import free_address

from dynsteer.controller.contract import encode_f32
from dynsteer.controller.zmq_protocol import (
    MAX_COMMAND_BYTES,
    SCHEMA_VERSION,
    ProtocolError,
    Reply,
    decode_command,
)
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.frontend.control_plane import ControlPlane
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.commands import RECEIVE_LIMIT, CommandServer
from dynsteer.engine_ext.server.runtime import DynsteerServer
from dynsteer.engine_ext.server.settings import ServerSettings
from dynsteer.engine_ext.zmq_security import SERVER_KEY_ENV, is_loopback

HIDDEN = 8
SITES = (("post_block", 0), ("post_block", 1))
KEY = "tenant-key"
REPLY_TIMEOUT_MS = 5000

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Bounded, reproducible, no per-example deadline (shared CI machines)."""

CASES: Counter[str] = Counter()
"""Frames sent per test (reported when the module finishes)."""


@pytest.fixture(scope="module", autouse=True)
def cases_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[None]:
    yield
    report_cases(request, tmp_path_factory, "test_fuzz_zmq", "fuzz frames", CASES)


# ---- one command server on its own event loop --------------------------------------------------
def make_state() -> FrontendState:
    """A 2-layer model of hidden size 8 with a registered vector and probe, so every command
    type can succeed."""
    state = FrontendState(options=EngineOptions(max_vectors=8), hidden_size=HIDDEN, num_layers=2,
                          sites=SITES)
    plane = ControlPlane(state)
    plane.register_vector("calm", np.ones(HIDDEN)).commit()
    plane.register_probe("p", np.ones(HIDDEN), 0.0, 1.0).commit()
    return state


class LiveCommands:
    """A :class:`CommandServer` serving on a background event loop, and a DEALER to talk to it
    (what a controller process does)."""

    def __init__(self, api_keys: list[str]) -> None:
        self.state = make_state()
        self.engine = FakeEngine()
        self.address = free_address()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> CommandServer:
            dyn = DynsteerServer(self.engine, self.state, ServerSettings(), api_keys, "tiny")
            server = CommandServer(dyn, self.address)
            server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.address)

    def total(self) -> int:
        """Frames the server has counted (handled plus rejected)."""
        return sum(self.server.handled.values()) + sum(self.server.rejected.values())

    def exchange(self, *frames: bytes) -> tuple[list[bytes], Reply]:
        """Send one multipart message; its reply's leading frames and the decoded
        :class:`Reply`. Fails when no reply comes (the command loop died)."""
        before = self.total()
        self.dealer.send_multipart(list(frames))
        assert self.dealer.poll(REPLY_TIMEOUT_MS), "no reply: the command loop stopped"
        answer = self.dealer.recv_multipart()
        assert self.total() == before + 1, "the frame was not counted exactly once"
        return answer[:-1], Reply.model_validate(msgspec.msgpack.decode(answer[-1]))

    def send(self, frame: bytes) -> Reply:
        return self.exchange(frame)[1]

    def snapshot(self) -> dict[str, Any]:
        """Everything a command can change: registry, global steering, sessions, probes'
        numbers, and the worker calls made."""
        s = self.state
        return {"vectors": {k: v.tobytes() for k, v in s.vectors.items()},
                "probes": {k: (p.threshold, p.sharpness) if p is not None else None
                           for k, p in s.probes.items()},
                "global": json.dumps(s.global_entries, sort_keys=True),
                "sessions": repr(list(s.sessions.items())),
                "generation": s.registry_generation, "rpc": list(self.engine.calls)}

    def close(self) -> None:
        self.dealer.close()
        self.context.term()
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCommands]:
    server = LiveCommands(api_keys=[])
    yield server
    server.close()


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveCommands]:
    server = LiveCommands(api_keys=[KEY])
    yield server
    server.close()


def assert_alive(live: LiveCommands) -> None:
    """The socket still answers a valid command after whatever came before."""
    reply = live.send(msgspec.msgpack.encode({"v": 1, "type": "ping", "id": "alive",
                                              "api_key": KEY}))
    assert reply.ok and reply.id == "alive" and reply.result == "pong", reply


def expect(frame: bytes) -> tuple[str | None, str | None]:
    """What the protocol says of ``frame``: (rejection reason, its message), or (None, None)
    for a valid command. ``decode_command`` must raise nothing but ProtocolError."""
    try:
        decode_command(frame)
    except ProtocolError as e:
        return e.reason, str(e)
    return None, None


def same_words(a: str | None, b: str | None) -> bool:
    return re.sub(r" at 0x[0-9a-f]+", "", a or "") == re.sub(r" at 0x[0-9a-f]+", "", b or "")


def check_reply(live: LiveCommands, frame: bytes, reply: Reply, before: Counter[str]) -> None:
    """The reply and the counters agree with what the protocol says of the frame."""
    reason, message = expect(frame)
    if reason == "malformed":
        # msgspec's nesting limit depends on the caller's stack depth, so a deeply nested
        # frame may be "nested too deeply" here and "not a map" in the server's thread.
        assert not reply.ok and reply.error, reply
    elif reason is not None:  # the same words (object reprs aside: their addresses differ)
        assert not reply.ok and same_words(reply.error, message), (reply, message)
    if reason is not None:
        assert live.server.rejected[reason] == before[reason] + 1, reason
        return
    command = decode_command(frame)
    assert reply.id == command.id
    assert "failed; see the server log" not in (reply.error or ""), reply  # an internal error
    if reply.ok:
        assert live.server.handled[command.type] >= 1
    else:
        assert reply.error, reply


# ---- strategies ---------------------------------------------------------------------------------
MSGPACK_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=16), st.binary(max_size=16),
    st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=8)),
    st.sampled_from([1e39, -1e39, 2**63, "", "\x00", "bad name", "../x", "x" * 300]))
FIELDS = st.sampled_from(["v", "type", "id", "api_key", "session", "steer", "gate", "name",
                          "vector", "vector_b64", "replace", "threshold", "sharpness", "layers",
                          "scale", "hook", "phase", "op"])
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(FIELDS, st.text(max_size=6), st.integers(-5, 5)), children,
                        max_size=5)),
    max_leaves=20)
"""Whatever msgpack can carry (ints beyond int64 excepted: msgpack has none)."""

ENTRY = {"vector": "calm", "layers": [1], "scale": 0.5}


@st.composite
def valid_command(draw: st.DrawFn) -> dict[str, Any]:
    """A command of each type that this server accepts."""
    kind = draw(st.sampled_from(["ping", "set_session", "clear_session", "set_global",
                                 "clear_global", "register_vector", "set_probe_threshold"]))
    command: dict[str, Any] = {"v": SCHEMA_VERSION, "type": kind,
                               "id": draw(st.text(max_size=12))}
    if kind in ("set_session", "clear_session"):
        command["session"] = draw(st.sampled_from(["conv-1", "u/c:2", "a.b@c"]))
    if kind == "set_session":
        command["steer"] = [ENTRY]
        if draw(st.booleans()):
            command["gate"] = {"probe": "p", "layer": 0, "steer": [ENTRY]}
    elif kind == "set_global":
        command["steer"] = draw(st.lists(st.just(ENTRY), max_size=2))
    elif kind == "register_vector":
        command["name"] = draw(st.sampled_from(["calm", "v1", "v2"]))
        command["replace"] = True
        values = draw(st.lists(st.floats(-1, 1), min_size=HIDDEN, max_size=HIDDEN))
        if draw(st.booleans()):
            command["vector"] = values
        else:
            command["vector_b64"] = encode_f32(values)
    elif kind == "set_probe_threshold":
        command["name"] = "p"
        command["threshold"] = draw(st.floats(-5, 5))
    return command


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*path, key)
            yield from _paths(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield (*path, i)
            yield from _paths(child, (*path, i))


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


@st.composite
def mistyped_command(draw: st.DrawFn) -> dict[str, Any]:
    """A valid command with one field (at any depth) replaced by any msgpack value, dropped,
    or joined by an unknown field."""
    command = draw(valid_command())
    path = draw(st.sampled_from(list(_paths(command))))
    action = draw(st.sampled_from(["replace", "replace", "drop", "extra"]))
    if action == "replace":
        return _replaced(command, path, draw(MSGPACK_VALUES))
    if action == "drop" and len(path) == 1:
        return {k: v for k, v in command.items() if k != path[0]}
    return {**command, draw(st.text(min_size=1, max_size=8)): draw(MSGPACK_VALUES)}


# ---- properties ---------------------------------------------------------------------------
def test_random_bytes_are_answered_counted_and_survived(live):
    @FUZZ
    @given(st.one_of(st.binary(max_size=512),
                     st.binary(max_size=64).map(lambda b: b"\x91" * 2000 + b)))
    def run(frame: bytes) -> None:
        CASES["random_bytes"] += 1
        before = Counter(live.server.rejected)
        check_reply(live, frame, live.send(frame), before)

    run()
    assert live.server.rejected["malformed"] > 0
    assert_alive(live)


def test_frames_that_crashed_the_decoder_are_malformed(live):
    """Two 4-byte-to-1-KB frames used to end the command loop for good (no reply to anything
    after them): a msgpack str that is not UTF-8 (msgspec before 0.23 raised
    UnicodeDecodeError, 0.23 a DecodeError, worded differently) and a kilobyte of nested
    arrays (RecursionError); both escaped ``decode_command``."""
    CASES["decoder_crashes"] += 3
    reply = live.send(b"\x9a\x0c\xa1\xaf")
    assert not reply.ok and reply.error.startswith("not msgpack: "), reply
    assert "utf-8" in reply.error.lower(), reply
    deep = msgspec.msgpack.encode({"v": 1, "type": "set_global", "steer": []})[:-1]
    for frame in (b"\x91" * 5000 + b"\xc0", deep + b"\x91" * 5000 + b"\xc0"):
        reply = live.send(frame)
        assert not reply.ok and reply.error == "not msgpack: nested too deeply", reply
    assert_alive(live)


def test_truncated_valid_commands_are_malformed(live):
    @FUZZ
    @given(valid_command(), st.data())
    def run(command: dict[str, Any], data: st.DataObject) -> None:
        CASES["truncated"] += 1
        frame = msgspec.msgpack.encode(command)
        cut = frame[:data.draw(st.integers(0, len(frame) - 1))]
        before = live.server.rejected["malformed"]
        reply = live.send(cut)
        assert not reply.ok and reply.error.startswith("not msgpack"), reply
        assert live.server.rejected["malformed"] == before + 1

    run()
    assert_alive(live)


def test_valid_commands_succeed(live):
    """The generator of valid commands produces commands the server applies (so the mutation
    tests below start from real commands)."""
    @settings(FUZZ, max_examples=60)
    @given(valid_command())
    def run(command: dict[str, Any]) -> None:
        CASES["valid"] += 1
        before = live.server.handled[command["type"]]
        reply = live.send(msgspec.msgpack.encode(command))
        assert reply.ok and reply.id == command["id"], reply
        assert live.server.handled[command["type"]] == before + 1

    run()


def test_wrong_msgpack_types_are_refused_naming_the_field(live):
    @settings(FUZZ, max_examples=300)
    @given(mistyped_command())
    def run(command: dict[str, Any]) -> None:
        CASES["mistyped"] += 1
        frame = msgspec.msgpack.encode(command)
        before = Counter(live.server.rejected)
        check_reply(live, frame, live.send(frame), before)

    run()
    assert live.server.rejected["invalid"] > 0
    assert_alive(live)


def test_other_schema_versions_are_refused(live):
    @FUZZ
    @given(valid_command(), MSGPACK_VALUES.filter(lambda v: v != SCHEMA_VERSION))
    def run(command: dict[str, Any], version: Any) -> None:
        CASES["version"] += 1
        before = live.server.rejected["version"]
        reply = live.send(msgspec.msgpack.encode({**command, "v": version}))
        assert not reply.ok and reply.error.startswith("v: schema version"), reply
        assert live.server.rejected["version"] == before + 1

    run()
    assert_alive(live)


@pytest.mark.parametrize("version", [True, 1.0])
def test_values_equal_to_the_version_but_not_it_are_refused(live, version):
    """``True == 1.0 == 1`` in Python; the version is the integer 1 only."""
    reply = live.send(msgspec.msgpack.encode({"v": version, "type": "ping", "id": "x"}))
    assert not reply.ok and reply.error.startswith("v: schema version"), reply


def test_oversized_frames_are_refused_before_decoding(live):
    """Over :data:`MAX_COMMAND_BYTES` is refused by its size, even as valid msgpack; at the
    limit a frame is decoded."""
    floats = [0.5] * (MAX_COMMAND_BYTES // 9 + 1)  # 9 bytes per float64 in msgpack
    big = msgspec.msgpack.encode({"v": 1, "type": "register_vector", "name": "big",
                                  "vector": floats})
    assert len(big) > MAX_COMMAND_BYTES
    def with_b64(n: int) -> bytes:
        return msgspec.msgpack.encode({"v": 1, "type": "register_vector", "name": "x",
                                       "vector_b64": "A" * n})

    overhead = len(with_b64(1 << 17)) - (1 << 17)
    at_limit = with_b64(MAX_COMMAND_BYTES - overhead)
    assert len(at_limit) == MAX_COMMAND_BYTES
    CASES["oversized"] += 3
    before = live.server.rejected["oversized"]
    for frame in (big, b"\x00" * (MAX_COMMAND_BYTES + 1)):
        reply = live.send(frame)
        assert not reply.ok and reply.error.startswith(f"command of {len(frame)} bytes"), reply
    assert live.server.rejected["oversized"] == before + 2
    reply = live.send(at_limit)
    assert not reply.ok and reply.error.startswith("vector"), reply
    assert live.server.rejected["oversized"] == before + 2
    assert_alive(live)


def test_frames_past_the_receive_limit_drop_the_sender(live):
    """Past :data:`RECEIVE_LIMIT` ZeroMQ drops the sender's connection instead of buffering
    the frame: no reply, nothing counted, and other controllers are still served."""
    CASES["oversized"] += 1
    dealer = live.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(live.address)
    before = live.total()
    try:
        dealer.send(b"\x00" * (RECEIVE_LIMIT + 1))
        assert not dealer.poll(1000), "a frame past the receive limit was answered"
    finally:
        dealer.close()
    assert live.total() == before
    assert_alive(live)


def test_multipart_frames_answer_their_last_part(live):
    """A DEALER may send several parts: the last is the command, the others are envelope and
    come back in front of the reply (as REQ sockets' empty delimiter does)."""
    @FUZZ
    @given(st.lists(st.binary(max_size=32), min_size=1, max_size=4),
           st.one_of(valid_command().map(msgspec.msgpack.encode), st.binary(max_size=64)))
    def run(extra: list[bytes], payload: bytes) -> None:
        CASES["multipart"] += 1
        before = Counter(live.server.rejected)
        envelope, reply = live.exchange(*extra, payload)
        assert envelope == extra
        check_reply(live, payload, reply, before)

    run()
    assert_alive(live)


def test_without_the_api_key_no_command_changes_anything(keyed):
    """With API keys configured, every command (valid or mutated) without a configured key is
    refused, and neither the frontend nor the workers see a change; the key makes the same
    command work."""
    start = keyed.snapshot()

    @settings(FUZZ, max_examples=200)
    @given(st.one_of(valid_command(), mistyped_command()),
           st.one_of(st.none(), st.just("wrong"), st.just(KEY + " "), st.just(KEY.upper()),
                     MSGPACK_SCALARS.filter(lambda v: v != KEY)))
    def run(command: dict[str, Any], key: Any) -> None:
        CASES["unkeyed"] += 1
        command = {**command}
        if key is None:
            command.pop("api_key", None)
        else:
            command["api_key"] = key
        reply = keyed.send(msgspec.msgpack.encode(command))
        assert not reply.ok, reply
        assert keyed.snapshot() == start

    run()
    assert keyed.server.rejected["unauthorized"] > 0
    CASES["unkeyed"] += 1
    command = {"v": 1, "type": "set_global", "steer": [ENTRY], "api_key": KEY}
    assert keyed.send(msgspec.msgpack.encode(command)).ok
    assert keyed.snapshot() != start


# ---- nothing is unpickled ------------------------------------------------------------------------
class Trap:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return open, (str(self.marker), "w")


def test_pickled_frames_are_never_unpickled(live, tmp_path):
    marker = tmp_path / "unpickled"
    CASES["pickle"] += pickle.HIGHEST_PROTOCOL + 1
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        frame = pickle.dumps(Trap(marker), protocol=protocol)
        reply = live.send(frame)
        assert not reply.ok and reply.error.startswith("not msgpack"), (protocol, reply)
    assert not marker.exists()
    assert_alive(live)


PACKAGES = ("controller", "probes", "engine_ext")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "jsonpickle", "joblib"}
UNSAFE_CALLS = {"torch.load", "np.load", "numpy.load", "yaml.load", "yaml.unsafe_load", "eval",
                "exec"}


def _call_name(node: ast.Call) -> str:
    """``name``, ``module.attr`` or ``?.attr`` (a method of some other expression)."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return f"{func.value.id if isinstance(func.value, ast.Name) else '?'}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else "?"


def test_no_product_module_can_unpickle():
    """A static guard for the whole product (every module that could receive network data):
    no pickle-like module is imported and no deserializer that runs code is called, so a
    future change cannot quietly add one."""
    root = Path(__file__).resolve().parents[1]
    files = [f for package in PACKAGES for f in (root / package).rglob("*.py")]
    assert len(files) > 40
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
            elif isinstance(node, ast.ImportFrom):
                bad = [node.module or ""] if (node.module or "").split(".")[0] in \
                    UNSAFE_MODULES else []
            elif isinstance(node, ast.Call):
                name = _call_name(node)
                bad = [name] if name in UNSAFE_CALLS or name.endswith(
                    (".recv_pyobj", ".recv_serialized")) else []
            else:
                continue
            found += [f"{file.relative_to(root)}:{node.lineno}: {name}" for name in bad]
    assert not found, found


# ---- where the sockets may bind ------------------------------------------------------------
def test_sockets_are_off_unless_configured():
    """Neither socket exists by default: no controller can reach an engine nobody opened."""
    options = EngineOptions()
    assert options.events_address is None and options.commands_address is None


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "[::]", "10.1.2.3", "eth0",
                                  "localhost.example.com", "127.0.0.1.nip.io"])
def test_the_command_socket_refuses_non_loopback_addresses_without_curve(host, monkeypatch):
    monkeypatch.delenv(SERVER_KEY_ENV, raising=False)
    port = free_address().rsplit(":", 1)[1]
    address = f"tcp://{host}:{port}"
    assert not is_loopback(address)

    async def start() -> None:
        dyn = DynsteerServer(FakeEngine(), make_state(), ServerSettings(), [], "tiny")
        CommandServer(dyn, address)

    with pytest.raises(ValueError, match=r"^dynsteer\.commands_address: .* is reachable from "
                                         r"other machines; bind it to 127\.0\.0\.1 or "
                                         r"configure CURVE keys"):
        asyncio.run(start())


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5", "tcp://127.0.0.2:5",
                                     "tcp://localhost:5", "tcp://[::1]:5", "ipc:///tmp/x",
                                     "inproc://x"])
def test_loopback_addresses(address):
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["udp://0.0.0.0:5555", "epgm://eth0;239.192.1.1:5555",
                                     "pgm://eth0;239.192.1.1:5555", "ws://0.0.0.0:5555",
                                     "tipc://{5560,0,0}", "vmci://1:5555", "0.0.0.0:5555"])
def test_other_transports_are_refused_as_options(address):
    """``is_loopback`` treats every non-tcp address as local (ipc, inproc), so the options must
    refuse transports that reach the network any other way (multicast, UDP, websockets)."""
    for option in ("events_address", "commands_address"):
        with pytest.raises(ValidationError, match="is not a ZeroMQ address"):
            EngineOptions(**{option: address})
