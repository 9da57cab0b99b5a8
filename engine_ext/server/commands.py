"""Controller commands over ZeroMQ: a ROUTER socket on the API server's event loop.

Each command (:data:`dynsteer.controller.zmq_protocol.Command`) is validated, applied through
the same control plane and lock as the HTTP routes (so every TP rank applies it in the same
order) and answered with a :class:`~dynsteer.controller.zmq_protocol.Reply`. Commands are
handled one at a time; ZeroMQ's high-water mark bounds what waits, and its message size limit
(:data:`RECEIVE_LIMIT`) what one frame may hold. A malformed, oversized or wrong-version frame
is counted (``rejected`` by reason) and answered with an error when its
sender can be addressed; nothing is ever unpickled.

With API keys configured, every command must carry one of them (``api_key``), and the session
it names is that key's namespace (:func:`.sessions.client`), as for requests: one tenant cannot
steer another's sessions.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from dynsteer.controller.contract import decode_f32
from dynsteer.controller.zmq_protocol import (
    MAX_COMMAND_BYTES,
    ClearGlobal,
    ClearSession,
    Ping,
    ProtocolError,
    RegisterVector,
    Reply,
    SetGlobal,
    SetProbeThreshold,
    SetSession,
    decode_command,
    encode,
)

from ..zmq_security import bind
from .runtime import DynsteerServer, WorkerError
from .sessions import client

logger = logging.getLogger("vllm.dynsteer.server")

RCVHWM = 1024
"""Commands ZeroMQ queues per controller before it stops taking more."""
RECEIVE_LIMIT = 2 * MAX_COMMAND_BYTES
"""Largest frame ZeroMQ takes in (``ZMQ_MAXMSGSIZE``): one up to it is received, counted and
answered as ``oversized``; a larger one makes ZeroMQ drop the sender's connection while the
frame arrives, so a hostile peer cannot make the server buffer a frame of any size."""


class CommandServer:
    """Serves commands on ``address`` for one :class:`DynsteerServer` (see the docstring)."""

    def __init__(self, server: DynsteerServer, address: str) -> None:
        self.server = server
        self.address = address
        self.handled: Counter[str] = Counter()
        """Commands applied, by type."""
        self.rejected: Counter[str] = Counter()
        """Frames refused, by reason (``malformed``, ``oversized``, ``version``, ``invalid``,
        ``unauthorized``, ``failed``)."""
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.RCVHWM, RCVHWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, RECEIVE_LIMIT)
        try:
            self._auth = bind(self._socket, address, "dynsteer.commands_address")
        except BaseException:  # an unclosed socket would make the context's term() hang
            self._socket.close()
            self._context.term()
            raise
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())
        logger.info("dynsteer: controller commands on %s", self.address)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._socket.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    async def _serve(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            # DEALER: [identity, payload]; REQ: [identity, b"", payload].
            if len(frames) < 2:
                self.rejected["malformed"] += 1
                continue
            envelope, payload = frames[:-1], frames[-1]
            reply = await self.handle(payload)
            await self._socket.send_multipart([*envelope, encode(reply)])

    async def handle(self, payload: bytes) -> Reply:
        """The reply to one command frame (never raises)."""
        try:
            command = decode_command(payload)
        except ProtocolError as e:
            self.rejected[e.reason] += 1
            return Reply(ok=False, error=str(e))
        except Exception:  # a decoder bug must not end the command loop either
            logger.exception("dynsteer: a command frame could not be decoded")
            self.rejected["malformed"] += 1
            return Reply(ok=False, error="not msgpack: could not be decoded")
        try:
            result = await self._apply(command)
        except PermissionError as e:
            self.rejected["unauthorized"] += 1
            return Reply(id=command.id, ok=False, error=str(e))
        except (ValueError, KeyError, WorkerError) as e:
            self.rejected["failed"] += 1
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return Reply(id=command.id, ok=False, error=str(message))
        except Exception:  # a bug of ours must not end the command loop
            logger.exception("dynsteer: command %s failed", command.type)
            self.rejected["failed"] += 1
            return Reply(id=command.id, ok=False, error=f"{command.type}: failed; see the "
                                                        "server log")
        self.handled[command.type] += 1
        return Reply(id=command.id, ok=True, result=result)

    async def _apply(self, command: Any) -> Any:
        server, plane = self.server, self.server.plane
        keys = server.api_keys
        if keys and command.api_key not in keys:
            raise PermissionError("api_key: this server has API keys; give one of them")
        if isinstance(command, Ping):
            return "pong"
        if isinstance(command, (SetSession, ClearSession)):
            session = client(command.api_key, keys).session(command.session)
            steering = (plane.session_steering(command.steer, command.gate)
                        if isinstance(command, SetSession) else None)
            server.frontend.set_session(session, steering)
            return {"session": command.session}
        if isinstance(command, SetGlobal):
            await server.apply(lambda: plane.set_global(command.steer))
        elif isinstance(command, ClearGlobal):
            await server.apply(plane.clear_global)
        elif isinstance(command, RegisterVector):
            if (command.vector is None) == (command.vector_b64 is None):
                raise ValueError("vector: give exactly one of vector or vector_b64")
            values = (np.asarray(command.vector, dtype=np.float32) if command.vector is not None
                      else decode_f32("vector_b64", command.vector_b64))
            await server.register_vector(command.name, values, command.replace)
        elif isinstance(command, SetProbeThreshold):
            await server.update_probe(command.name, command.threshold, command.sharpness)
        return None

    def stats(self) -> dict[str, dict[str, int]]:
        return {"handled": dict(self.handled), "rejected": dict(self.rejected)}
