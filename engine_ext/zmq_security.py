"""Binding dynsteer's ZeroMQ sockets: loopback unless CURVE keys are configured.

The keys are files written by ``zmq.auth.create_certificates`` (``python -m
zmq.auth.certs`` or ``dynsteer``'s docs): the server's secret certificate
(:data:`SERVER_KEY_ENV`) and a folder of the public certificates of the clients allowed in
(:data:`CLIENT_KEYS_ENV`). They come from the environment, never from ``additional_config``
(which vLLM logs). With a server key every socket requires CURVE and a known client key: an
unkeyed or unknown client gets nothing (ZeroMQ's ZAP handshake refuses it before any message).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER_KEY_ENV = "DYNSTEER_ZMQ_SERVER_KEY"
CLIENT_KEYS_ENV = "DYNSTEER_ZMQ_CLIENT_KEYS"


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ address only listens on this machine (ipc/inproc, or a loopback IP)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(socket: zmq.Socket, address: str, option: str) -> ThreadAuthenticator | None:
    """Bind ``socket`` at ``address``, with CURVE when a server key is configured; returns the
    authenticator to stop when the socket closes. ValueError naming ``option`` (the setting the
    address came from) for a non-loopback address without keys."""
    secret_path = os.environ.get(SERVER_KEY_ENV)
    auth = None
    if secret_path:
        clients = os.environ.get(CLIENT_KEYS_ENV)
        if not clients or not os.path.isdir(clients):
            raise ValueError(f"{CLIENT_KEYS_ENV}: set it to the folder of the public "
                             f"certificates of allowed clients (with {SERVER_KEY_ENV})")
        public, secret = zmq.auth.load_certificate(secret_path)
        if secret is None:
            raise ValueError(f"{SERVER_KEY_ENV}: {secret_path} holds no secret key")
        auth = ThreadAuthenticator(_sync_context(socket.context))
        auth.start()
        auth.configure_curve(domain="*", location=clients)
        socket.curve_secretkey, socket.curve_publickey = secret, public
        socket.curve_server = True
    elif not is_loopback(address):
        raise ValueError(f"{option}: {address} is reachable from other machines; bind it to "
                         f"127.0.0.1 or configure CURVE keys ({SERVER_KEY_ENV}, "
                         f"{CLIENT_KEYS_ENV})")
    socket.bind(address)
    return auth


def _sync_context(context: Any) -> zmq.Context:
    """A blocking context over the same ZeroMQ context (ZAP is per context)."""
    return zmq.Context.shadow(context.underlying)
