"""The ZeroMQ protocol between a dynsteer engine and asynchronous controllers. No vLLM import.

Two sockets, both bound by the engine side (loopback by default; CURVE when keys are set):

* **events** (PUB, bound by the worker whose output the scheduler sees): two frames,
  ``[topic, payload]``; ``topic`` is the event type (``b"request_started"``, ``b"monitor"``,
  ``b"request_finished"``) so a subscriber can filter, ``payload`` a msgpack map
  (:class:`Event` and its subclasses) with the schema version ``v`` and a sequence number
  ``seq`` that grows by one per event published: a gap means events were dropped (the engine's
  queue was full, or the subscriber's high-water mark was reached).
* **commands** (ROUTER, bound by the frontend that owns the control plane): a DEALER sends one
  frame, a msgpack map (:data:`Command`); the engine answers each with a :class:`Reply` that
  echoes the command's ``id``. Commands go through the same control plane as the HTTP routes,
  so every tensor-parallel rank applies them identically.

Malformed, oversized (:data:`MAX_COMMAND_BYTES`) or unknown-version messages are counted and
answered with an error when they can be (never decoded with pickle: msgpack only).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .limits import FiniteFloat
from .spec import MAX_ENTRIES, SESSION_PATTERN, GateSpec, SteerEntry

SCHEMA_VERSION = 1
"""Version of every message (``v``); a message of another version is refused."""

MAX_COMMAND_BYTES = 4 * 1024 * 1024
"""Largest command frame the engine reads (a hidden-size vector as floats is ~100 KiB)."""

Session = Annotated[str, Field(pattern=SESSION_PATTERN)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = SCHEMA_VERSION


# ---- events (engine -> controllers) ------------------------------------------------------
class Event(_Message):
    seq: int
    """Events published before this one (per publisher; a gap means drops)."""
    time: float
    """Publisher's wall clock (seconds since the epoch)."""


class RequestStarted(Event):
    type: Literal["request_started"] = "request_started"
    request_id: str
    session: str | None
    static: bool
    """The request has static steering of its own."""
    gated: bool
    controller: str | None
    """Its sync controller's name, if any."""


class Monitor(Event):
    """Per-request monitor summaries of the last ``steps`` steps (parallel lists), for the
    gated requests that ran in them."""

    type: Literal["monitor"] = "monitor"
    step: int
    steps: int
    request_id: list[str]
    session: list[str | None]
    tokens: list[int]
    """Positions monitored in the window."""
    gated: list[int]
    """Of those, with gate > 0.5."""
    max_score: list[float | None]


class RequestFinished(Event):
    type: Literal["request_finished"] = "request_finished"
    request_id: str
    session: str | None
    telemetry: dict[str, Any] | None
    """The request's gate report (None: it had no gate)."""


EVENT_TYPES: dict[str, type[Event]] = {
    c.model_fields["type"].default: c for c in (RequestStarted, Monitor, RequestFinished)}


# ---- commands (controllers -> engine) ----------------------------------------------------
class _Command(_Message):
    id: Annotated[str, Field(max_length=128)] = ""
    """Echoed in the reply."""
    api_key: str | None = None
    """The tenant's API key, when the server has keys: sessions are namespaced by it."""


class SetSession(_Command):
    """Steer the session's *later* requests: ``steer`` is added to their own entries, ``gate``
    replaces a gate they do not have."""

    type: Literal["set_session"] = "set_session"
    session: Session
    steer: list[SteerEntry] = Field(default_factory=list, max_length=MAX_ENTRIES)
    gate: GateSpec | None = None


class ClearSession(_Command):
    type: Literal["clear_session"] = "clear_session"
    session: Session


class SetGlobal(_Command):
    type: Literal["set_global"] = "set_global"
    steer: list[SteerEntry] = Field(max_length=MAX_ENTRIES)


class ClearGlobal(_Command):
    type: Literal["clear_global"] = "clear_global"


class RegisterVector(_Command):
    type: Literal["register_vector"] = "register_vector"
    name: str
    vector: list[FiniteFloat] | None = None
    vector_b64: str | None = None
    replace: bool = False


class SetProbeThreshold(_Command):
    """Change a registered probe's threshold (and sharpness) for requests admitted later."""

    type: Literal["set_probe_threshold"] = "set_probe_threshold"
    name: str
    threshold: FiniteFloat
    sharpness: Annotated[FiniteFloat, Field(gt=0)] | None = None


class Ping(_Command):
    type: Literal["ping"] = "ping"


Command = Annotated[SetSession | ClearSession | SetGlobal | ClearGlobal | RegisterVector
                    | SetProbeThreshold | Ping, Field(discriminator="type")]
_COMMAND = TypeAdapter(Command)


class Reply(_Message):
    id: str = ""
    ok: bool
    error: str | None = None
    """What was wrong (field named), when not ok."""
    result: Any = None


class ProtocolError(ValueError):
    """A message that is not a valid one of this protocol (the reason names the field)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        """Counter label: ``oversized``, ``malformed``, ``version`` or ``invalid``."""


def encode(message: BaseModel) -> bytes:
    return msgspec.msgpack.encode(message.model_dump(mode="json"))


def decode_command(frame: bytes) -> Any:
    """A command frame as its model; :class:`ProtocolError` says why not."""
    if len(frame) > MAX_COMMAND_BYTES:
        raise ProtocolError("oversized", f"command of {len(frame)} bytes; the limit is "
                                         f"{MAX_COMMAND_BYTES}")
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # a str that is not UTF-8
        raise ProtocolError("malformed", f"not msgpack: {e}") from None
    except RecursionError:  # msgspec's nesting limit: ~1 KB of nested arrays reach it
        raise ProtocolError("malformed", "not msgpack: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", "a command is a msgpack map")
    version = raw.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # not True, not 1.0
        raise ProtocolError("version", f"v: schema version {version!r} is not supported "
                                       f"(this engine speaks {SCHEMA_VERSION})")
    try:
        return _COMMAND.validate_python(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = list(first["loc"])
        if loc and loc[0] == raw.get("type"):  # the union's tag, not a field
            loc = loc[1:]
        raise ProtocolError("invalid", f"{'.'.join(map(str, loc)) or 'type'}: "
                                       f"{first['msg']}") from None


def decode_event(topic: bytes, payload: bytes) -> Event:
    """An event's frames as its model (ValueError for anything else)."""
    cls = EVENT_TYPES.get(topic.decode("ascii", "replace"))
    if cls is None:
        raise ValueError(f"unknown event topic {topic!r}")
    return cls.model_validate(msgspec.msgpack.decode(payload))
