"""Who sent the request being admitted: the identity travels with the request, not its bytes.

A spec's ``session`` belongs to whoever authenticated the request, and only a request the
frontend makes itself may carry dynsteer's reserved ``extra_args`` keys. Both are decided at
admission, where the spec is parsed, from the :class:`Caller` of the request: the API server
sets it per HTTP request (from the bearer key, whatever the route or the body's encoding) in a
context variable that follows the request through vLLM into the input processor (see
:func:`dynsteer.engine_ext.compat.frontend.install`). A request admitted with no caller set gets
its engine's default: :data:`TRUSTED` for the offline ``LLM`` (the process owner's own
requests), a keyless client on the API server, so a path that loses the context fails closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The identity a request is admitted under."""

    namespace: str | None
    """Prefix of the caller's session names (``<digest>/``); None: names are taken as given
    (no API keys configured, or the process owner)."""
    client: bool
    """It came over the network: dynsteer's reserved ``extra_args`` keys are refused."""

    def session(self, name: str) -> str:
        """``name`` in this caller's namespace. A name already in it (as events show it, and a
        controller may send it back) is not prefixed again."""
        if self.namespace is None or name.startswith(self.namespace):
            return name
        return self.namespace + name


TRUSTED = Caller(namespace=None, client=False)
"""The process owner (offline API, the frontend's own capture requests)."""

_current: ContextVar[Caller | None] = ContextVar("dynsteer_caller", default=None)


def current(default: Caller) -> Caller:
    """The caller of the request being handled (``default`` when none was set)."""
    caller = _current.get()
    return default if caller is None else caller


@contextmanager
def acting_as(caller: Caller) -> Iterator[None]:
    """Admit the requests made inside (and in tasks started inside) as ``caller``."""
    token = _current.set(caller)
    try:
        yield
    finally:
        _current.reset(token)
