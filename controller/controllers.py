"""Synchronous per-step controllers: memory and policy on top of the in-graph gate.

A request picks one in its spec (``"controller": {"name": "latch", "k": 2}``); the request must
have a gate, whose probe scores the controller reads. Two kinds exist:

* **Built-in** controllers (:data:`BUILTINS`: ``latch``, ``hysteresis``, ``proportional``,
  ``budget``) keep their state per request on the device. After every forward one small
  kernel folds the step's scores into that state, and the monitor applies it to the next
  step's gates: ``gate' = max(gate, floor) * scale`` with the request's ``floor`` and
  ``scale``. No host work per request and no wait for the GPU; a decision takes effect from
  the very next step.
* **Python** controllers (subclasses of :class:`Controller`, registered through the
  entry-point group :data:`ENTRY_POINT_GROUP`) get a vectorized :class:`StepView` of their
  requests' tokens once per step and return :class:`Actions`. The view of step ``n`` is read
  back from the device without stalling the GPU, so its actions apply from step ``n + 2``
  (:data:`PYTHON_LAG`): one step is always in flight while the next is prepared, and waiting
  for it would idle the GPU. Every rank calls the controller with the same views at the same
  steps, so every tensor-parallel rank applies the same actions.

Per-request state lives in the controller (one instance per worker and controller class),
keyed by the ``request`` handles of the views. No vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from importlib.metadata import entry_points
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .contract import SpecError
from .limits import FiniteFloat

logger = logging.getLogger("dynsteer.controller")

ENTRY_POINT_GROUP = "dynsteer.controllers"
"""Entry-point group of third-party controllers: ``name = "module:ControllerClass"``."""

PYTHON_LAG = 2
"""A Python controller's actions computed from step ``n`` apply from step ``n + PYTHON_LAG``."""

PREFILL, DECODE = 0, 1
"""Values of :attr:`StepView.phase`."""


class Action(IntEnum):
    """What a controller can do to one request (``value`` in :class:`Actions`)."""

    ENABLE = 0
    """Gated tier on (scale 1)."""
    DISABLE = 1
    """Gated tier off (scale 0): the gate is computed, nothing is steered by it."""
    LATCH = 2
    """The gate is 1 on every later token (``value`` 0 undoes it)."""
    SCALE = 3
    """Multiply the gate by ``value``."""
    SWITCH_VECTOR = 4
    """Gated entries steer with the registered vector ``names[int(value)]`` instead."""
    SWITCH_PROBE = 5
    """The gate reads the registered probe ``names[int(value)]`` instead (same site)."""
    STOP = 6
    """No steering at all for the rest of the request (static and gated)."""


@dataclass(frozen=True)
class StepView:
    """One step's tokens of one controller's requests, in batch order (whole arrays).

    ``request`` handles are unique for the worker's lifetime (a finished request's handle is
    never reused), so a controller's state keyed by them never mixes two requests.
    """

    step: int
    """The engine step these tokens ran in (counted from the worker's start)."""
    request: np.ndarray
    """int64 ``[T]``: the request handle of each token."""
    session: np.ndarray
    """int64 ``[T]``: each token's session code (0: none), see :attr:`sessions`."""
    phase: np.ndarray
    """int8 ``[T]``: :data:`PREFILL` (prompt position) or :data:`DECODE`."""
    position: np.ndarray
    """int64 ``[T]``: position in the request's sequence."""
    score: np.ndarray
    """float32 ``[T]``: the probe score at the monitor site."""
    gate: np.ndarray
    """float32 ``[T]``: the gate the token was steered with (after this controller's state)."""
    sessions: Mapping[int, str] = field(default_factory=dict)
    """Session code -> the ``session`` of the request's spec."""


@dataclass(frozen=True)
class Actions:
    """Actions for some requests, as parallel arrays (empty: nothing to do)."""

    request: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    action: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    """:class:`Action` values."""
    value: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    names: tuple[str, ...] = ()
    """Registered vector / probe names the switch actions index into."""

    @classmethod
    def of(cls, request: Any, action: Any, value: Any = 0.0,
           names: tuple[str, ...] = ()) -> Actions:
        """Actions from array-likes (scalars broadcast): ``Actions.of(ids, Action.LATCH)``."""
        req = np.atleast_1d(np.asarray(request, dtype=np.int64))
        act = np.broadcast_to(np.asarray(action, dtype=np.int8), req.shape).copy()
        val = np.broadcast_to(np.asarray(value, dtype=np.float32), req.shape).copy()
        return cls(req, act, val, tuple(names))

    def __len__(self) -> int:
        return len(self.request)

    def check(self) -> Actions:
        """Self, after checking what a controller returned (ValueError naming the problem)."""
        n = len(self.request)
        if self.action.shape != (n,) or self.value.shape != (n,):
            raise ValueError("Actions: request, action and value must have equal lengths")
        if n and not np.isin(self.action, [a.value for a in Action]).all():
            raise ValueError("Actions.action: unknown action code")
        if n and not np.isfinite(self.value).all():
            raise ValueError("Actions.value: values must be finite")
        switch = np.isin(self.action, [Action.SWITCH_VECTOR, Action.SWITCH_PROBE])
        if switch.any() and ((self.value[switch] < 0).any()
                             or (self.value[switch] >= len(self.names)).any()):
            raise ValueError("Actions.value: a switch action must index into names")
        return self


class NoParams(BaseModel):
    """A controller without parameters."""

    model_config = ConfigDict(extra="forbid")


class Controller:
    """Base class of Python controllers (see the module docstring).

    Subclasses set :attr:`name` and :attr:`Params` (a pydantic model of the spec's parameters;
    the spec is refused with the field named when they do not validate) and implement
    :meth:`step`. A controller that raises is disabled for the requests of that call (their
    gate keeps its last state; the error is logged and flagged in their telemetry).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams

    def admit(self, request: int, params: BaseModel, session: str | None) -> None:
        """A request of this controller was admitted (before its first step)."""

    def finish(self, request: int) -> None:
        """A request finished (its handle will not be seen again)."""

    def step(self, view: StepView) -> Actions:
        raise NotImplementedError


class BuiltinController(Controller):
    """A controller the device runs (see the module docstring); its host class only describes
    it. ``device_params`` lays its parameters out for the kernel (three floats, NaN: unset)."""

    kind: ClassVar[int] = 0

    @staticmethod
    def device_params(params: Any) -> tuple[float, float, float]:
        raise NotImplementedError

    @staticmethod
    def initial_state(params: Any) -> tuple[float, float]:
        """(floor, scale) before the request's first step: the plain gate."""
        return 0.0, 1.0

    def step(self, view: StepView) -> Actions:  # pragma: no cover - never called
        raise TypeError(f"{self.name} runs on the device")


_NAN = float("nan")


class LatchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(default=1, ge=1, le=1 << 30)
    """Tokens above the threshold that latch the gate."""
    threshold: FiniteFloat | None = None
    """A token counts when its probe score is above this (default: when its gate > 0.5)."""


class Latch(BuiltinController):
    """Steer as the gate says until ``k`` tokens were above the threshold, then steer every
    remaining token of the request fully (gate 1)."""

    name, kind, Params = "latch", 1, LatchParams

    @staticmethod
    def device_params(params: Any) -> tuple[float, float, float]:
        t = _NAN if params.threshold is None else params.threshold
        return float(params.k), float(t), _NAN


class HysteresisParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    t_on: FiniteFloat
    """Steering switches on when a token's probe score is above this..."""
    t_off: FiniteFloat
    """...and off when one is below this (``t_off <= t_on``)."""

    def model_post_init(self, _: Any) -> None:
        if self.t_off > self.t_on:
            raise ValueError("t_off must be at most t_on")


class Hysteresis(BuiltinController):
    """Off until a token's score exceeds ``t_on``; then every token is steered fully (gate 1)
    until a token's score falls below ``t_off``; and so on. Within a step the last crossing
    counts."""

    name, kind, Params = "hysteresis", 2, HysteresisParams

    @staticmethod
    def initial_state(params: Any) -> tuple[float, float]:
        return 1.0, 0.0  # off; once on, every token fully

    @staticmethod
    def device_params(params: Any) -> tuple[float, float, float]:
        return float(params.t_on), float(params.t_off), _NAN


class ProportionalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gain: FiniteFloat = 1.0
    threshold: FiniteFloat = 0.0
    max: Annotated[FiniteFloat, Field(gt=0)] = 1.0
    """Largest gate (``score - threshold`` is clamped to ``[0, max]`` before the gain)."""


class Proportional(BuiltinController):
    """The gate of every token is ``gain * clamp(score - threshold, 0, max)`` with the score
    of the request's last token of the previous step (0 before the first step)."""

    name, kind, Params = "proportional", 3, ProportionalParams

    @staticmethod
    def initial_state(params: Any) -> tuple[float, float]:
        return 1.0, 0.0  # the gate is the scale alone

    @staticmethod
    def device_params(params: Any) -> tuple[float, float, float]:
        return float(params.gain), float(params.threshold), float(params.max)


class BudgetParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=0, le=1 << 30)
    """Most tokens steered by the gate (gate > 0.5) per request."""


class Budget(BuiltinController):
    """Steer as the gate says until ``tokens`` tokens were steered, then stop gated steering.
    Counted at step boundaries: a prompt chunk that crosses the budget is steered whole."""

    name, kind, Params = "budget", 4, BudgetParams

    @staticmethod
    def initial_state(params: Any) -> tuple[float, float]:
        return 0.0, 1.0 if params.tokens else 0.0

    @staticmethod
    def device_params(params: Any) -> tuple[float, float, float]:
        return float(params.tokens), _NAN, _NAN


BUILTINS: dict[str, type[BuiltinController]] = {
    c.name: c for c in (Latch, Hysteresis, Proportional, Budget)}


_found: dict[str, type[Controller]] | None = None


def available(refresh: bool = False) -> dict[str, type[Controller]]:
    """Every controller by name: built-ins, then the entry points (scanned once per process,
    again with ``refresh``; a broken entry point is logged and skipped)."""
    global _found
    if _found is not None and not refresh:
        return _found
    found: dict[str, type[Controller]] = dict(BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        try:
            cls = ep.load()
        except Exception as e:  # a broken third-party package must not stop the others
            logger.warning("dynsteer: controller entry point %r failed to load: %r", ep.name, e)
            continue
        if isinstance(cls, type) and issubclass(cls, Controller):
            found[ep.name] = cls
    _found = found
    return found


def controller_class(name: str, where: str = "controller.name") -> type[Controller]:
    """The controller class called ``name`` (SpecError listing the known ones)."""
    known = available()
    if name not in known:  # installed since the last scan?
        known = available(refresh=True)
    if name not in known:
        raise SpecError(f"{where}: unknown controller {name!r} (known: "
                        f"{', '.join(sorted(known))}); install a package that registers it "
                        f"under the entry-point group {ENTRY_POINT_GROUP!r}")
    return known[name]


def parse_params(cls: type[Controller], raw: Mapping[str, Any], where: str) -> BaseModel:
    """The controller's parameters validated by its ``Params`` (SpecError naming the field)."""
    try:
        return cls.Params.model_validate(dict(raw))
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise SpecError(f"{where}{'.' + loc if loc else ''}: {message}") from None

