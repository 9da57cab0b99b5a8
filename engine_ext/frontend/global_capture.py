"""The global capture: a capture every request that asks for none gets, into a sink.

It starts as the engine option ``dynsteer.global_capture`` and, on a server, is set and
scoped by ``PUT /v1/dynsteer/capture/global`` (to one session, or to one API key's callers).
The server adds it to a completion's body before vLLM reads it, so the response reports the
capture; admission adds it to any other request (an offline engine's), so both see the same
rule (:func:`capture_for`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dynsteer.controller.extra_args import SPEC_KEY

from .caller import current

if TYPE_CHECKING:
    from .admission import FrontendState


def capture_for(state: FrontendState, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The global capture to add to a request whose spec is ``spec`` (None: it has a capture
    of its own, there is none, or its scope leaves the request out). A ``when: "gated"`` one
    goes only to a spec with a gate. The caller is the one in context."""
    capture, scope = state.global_capture, state.global_capture_scope
    if capture is None or "capture" in spec:
        return None
    if capture.get("when") == "gated" and not spec.get("gate"):
        return None
    caller = current(state.default_caller)
    if scope.get("caller") is not None and caller.namespace != scope["caller"]:
        return None
    if scope.get("session") is not None:
        session = spec.get("session")
        if not isinstance(session, str) or caller.session(session) != scope["session"]:
            return None
    return capture


def with_global_capture(state: FrontendState, extra_args: dict[str, Any] | None
                        ) -> dict[str, Any] | None:
    """``extra_args`` with the global capture added to its spec where it applies (a new dict;
    the caller's is left as it is). A spec that is not a JSON object is left for admission
    to refuse."""
    raw = (extra_args or {}).get(SPEC_KEY, {})
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError:
            return extra_args
    if not isinstance(raw, dict):
        return extra_args
    capture = capture_for(state, raw)
    if capture is None:
        return extra_args
    return {**(extra_args or {}), SPEC_KEY: {**raw, "capture": capture}}
