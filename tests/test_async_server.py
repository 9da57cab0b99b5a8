"""Asynchronous controllers end to end: `dynsteer serve` with events and commands on loopback,
and a real `dynsteer controller run` process (the built-in SessionGuard).

Request 1 of session S trips the probe; the controller, seeing its finished event, commands
steering for S; request 2 of S is steered exactly as if it carried that steering itself, the
same request in session T (or in S without the API key, another namespace) is not. Killing the
controller leaves the engine serving; bad command frames are answered, counted and dropped.
Both sockets require CURVE: the controller and the test's own client hold keys the server
knows; a client without keys, or with unknown ones, gets nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth
from server_utils import Server, http

from dynsteer.controller.zmq_protocol import MAX_COMMAND_BYTES, Ping, Reply, encode

pytestmark = pytest.mark.engine

KEY = "tenant-key"
RNG = np.random.default_rng(11)
PROBE = (RNG.standard_normal(128) / 128**0.5).tolist()
GUARD_STEER = [{"vector": (RNG.standard_normal(128) * 6).tolist(), "layers": [2]}]
TRIP = {"gate": {"probe": {"weights": PROBE, "threshold": -1000.0}, "layer": 1,
                 "steer": [{"vector": (RNG.standard_normal(128) * 0.1).tolist(),
                            "layers": [1]}]}}
"""A gate that fires on every token (what makes the controller act)."""


@pytest.fixture(scope="module")
def stack(chat_model, tmp_path_factory):
    """The server and the controller process, with the server's events and commands."""
    folder = tmp_path_factory.mktemp("async")
    # ipc addresses: a loopback port picked now could be taken by another engine before the
    # server binds it.
    events, commands = (f"ipc://{folder / name}" for name in ("events", "commands"))
    clients = folder / "clients"
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(folder, "server")
    client_public, client_secret = zmq.auth.create_certificates(folder, "client")
    (clients / "client.key").write_bytes(Path(client_public).read_bytes())
    server = Server(chat_model, folder / "serve.log", "--dynsteer-api-key", KEY,
                    "--dynsteer-events", events, "--dynsteer-events-every", "1",
                    "--dynsteer-commands", commands,
                    "--dynsteer-zmq-server-key", str(server_secret),
                    "--dynsteer-zmq-client-keys", str(clients))
    log = (folder / "controller.log").open("w")
    controllers: list[subprocess.Popen] = []

    def start_controller() -> subprocess.Popen:
        config = json.dumps({"steer": GUARD_STEER, "api_key": KEY})
        controllers.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "dynsteer"), "controller", "run",
             "dynsteer.controller.examples:SessionGuard", "--events", events, "--commands",
             commands, "--config", config, "--server-key", str(server_public),
             "--client-key", str(client_secret)], stdout=log, stderr=subprocess.STDOUT))
        return controllers[-1]

    try:
        server.wait_ready()
        controller = start_controller()
        server_key = zmq.auth.load_certificate(server_public)[0]
        keys = (server_key, *zmq.auth.load_certificate(client_secret))
        yield server, controller, commands, keys, start_controller
    finally:
        for process in controllers:
            process.kill()
            process.wait()
        log.close()
        server.stop()


def complete(server, session: str | None = None, spec: dict | None = None,
             key: str | None = KEY) -> np.ndarray:
    """Greedy completion logprobs of a fixed prompt."""
    body_spec = dict(spec or {})
    if session is not None:
        body_spec["session"] = session
    model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    body = {"model": model, "prompt": "Tell me about the sea", "max_tokens": 6,
            "temperature": 0.0, "logprobs": 1, **({"dynsteer": body_spec} if body_spec else {})}
    status, reply = http("POST", server.url + "/v1/completions", body, api_key=key)
    assert status == 200, reply
    return np.array(reply["choices"][0]["logprobs"]["token_logprobs"], dtype=float)


def _metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    pattern = "^" + re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + " (\\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def session_commands(server) -> float:
    return _metric(http("GET", server.url + "/metrics")[1], "dynsteer_commands_handled_total",
                   'type="set_session"')


def wait_until(predicate, timeout: float = 90.0, action=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if action is not None:
            action()
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError("timed out")


def test_a_tripped_session_is_steered_from_its_next_request(stack):
    server, controller, *_ = stack
    # The controller subscribes a moment after it starts: trip a warm-up session until it acts.
    wait_until(lambda: session_commands(server) >= 1,
               action=lambda: complete(server, "warm-up", TRIP))
    before = session_commands(server)
    complete(server, "S", TRIP)
    wait_until(lambda: session_commands(server) >= before + 1)
    steered = complete(server, "S")
    other = complete(server, "T")
    unkeyed = complete(server, "S", key=None)  # no bearer: another namespace than KEY's
    explicit = complete(server, None, {"steer": GUARD_STEER})
    np.testing.assert_allclose(steered, explicit, atol=1e-4)
    assert np.abs(steered - other).max() > 1e-2
    np.testing.assert_allclose(unkeyed, other, atol=1e-4)
    assert controller.poll() is None


def dealer_for(commands: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = keys
    dealer.connect(commands)
    return dealer


def test_unkeyed_and_unknown_clients_get_nothing(stack):
    _, _, commands, keys, _ = stack
    stranger = (keys[0], *zmq.curve_keypair())
    for client_keys in (None, stranger):
        dealer = dealer_for(commands, client_keys)
        try:
            try:  # the server may drop the connection before the frame is queued on it
                dealer.send(encode(Ping(id="x", api_key=KEY)), zmq.NOBLOCK)
            except zmq.Again:
                continue
            assert not dealer.poll(2000), "an unknown client got a reply"
        finally:
            dealer.close()


def test_bad_command_frames_are_answered_and_counted(stack):
    server, _, commands, keys, _ = stack
    dealer = dealer_for(commands, keys)
    frames = [b"\x00not msgpack", b"x" * (MAX_COMMAND_BYTES + 1),
              msgspec.msgpack.encode({"v": 9, "type": "ping"}), encode(Ping(id="nokey")),
              encode(Ping(id="ok", api_key=KEY))]
    replies = []
    try:
        for frame in frames:
            dealer.send(frame)
            assert dealer.poll(10_000), "no reply"
            replies.append(Reply.model_validate(msgspec.msgpack.decode(dealer.recv())))
    finally:
        dealer.close()
    assert [r.ok for r in replies] == [False, False, False, False, True]
    assert replies[3].error.startswith("api_key:") and replies[4].result == "pong"
    text = http("GET", server.url + "/metrics")[1]
    for reason in ("malformed", "oversized", "version", "unauthorized"):
        assert _metric(text, "dynsteer_commands_rejected_total", f'reason="{reason}"') >= 1
    assert _metric(text, "dynsteer_events_published_total") > 0


def test_killing_the_controller_leaves_the_engine_serving(stack):
    """Killed mid-traffic: every request in flight and after it is served, nothing is
    commanded any more; a restarted controller steers sessions again."""
    server, controller, *_, start_controller = stack
    results: list[int] = []

    def traffic() -> None:
        for i in range(8):
            results.append(len(complete(server, f"during-{i}", TRIP)))

    background = threading.Thread(target=traffic)
    background.start()
    controller.kill()
    controller.wait()
    background.join(timeout=300)
    assert results == [6] * 8
    time.sleep(1.0)  # commands the controller sent before dying are handled by now
    before = session_commands(server)
    for session in ("after-1", "after-2"):
        assert len(complete(server, session, TRIP)) == 6
    assert session_commands(server) == before
    assert http("GET", server.url + "/v1/dynsteer/health")[0] == 200

    restarted = start_controller()
    wait_until(lambda: session_commands(server) > before,
               action=lambda: complete(server, "after-restart", TRIP))
    wait_until(lambda: np.abs(complete(server, "after-restart")
                              - complete(server, None, {"steer": GUARD_STEER})).max() < 1e-4)
    assert restarted.poll() is None
