"""Steering by position: the stretches of a request whose entries name ``positions``.

An entry with ``positions`` (:mod:`dynsteer.controller.positions`) steers only some positions
of its request, so which entries steer a token depends on the token's position, not only on
its phase. At admission the request's positions are cut into *stretches* over which the set of
active entries (and the phase) is constant: the cuts are the ends of every entry's positions,
intersected with its phase, and the end of the prompt. Each stretch is a spec of its own (its
active entries, no positions) with a key naming them, so it takes a row like any spec, shared
with every request whose stretch has the same entries; the step's index then maps each token to
the row of the stretch its position falls in (:mod:`.token_rows`), a vectorized search over
per-slot tables (:class:`.slots.SlotTable`).

Negative positions and generated-token offsets count from the end of the prompt, so the
stretches are computed per request, at admission; pure Python and numpy, no device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynsteer.controller.positions import END, MAX_CUTS, steered
from dynsteer.controller.wire import WireEntry, read_entries

from .resolve import Resolved

MAX_STRETCHES = MAX_CUTS + 2
"""Most stretches of one request: from the start, the end of the prompt and every cut the
spec allows (checked by the frontend)."""


@dataclass(frozen=True)
class Stretch:
    """Positions ``start`` up to the next stretch's start, all of one phase, steered by the
    same entries."""

    start: int
    phase: str
    """``prefill`` or ``decode``."""
    key: str
    """The request's spec key and the active entries: the stretch's rows' key."""
    resolved: Resolved


def positioned(wire: dict[str, Any] | None) -> bool:
    """Whether some entry of the spec names positions."""
    if wire is None:
        return False
    gate = wire["gate"]
    entries = [*wire["steer"], *(gate["steer"] if gate is not None else ())]
    return any(e.positions is not None for e in read_entries(entries))


def stretches(wire: dict[str, Any], prompt_len: int,
              resolve: Callable[[dict[str, Any]], Resolved]) -> list[Stretch]:
    """The request's stretches, first at position 0; ``resolve`` builds a stretch's spec
    (the registry's cached resolution). ValueError past :data:`MAX_STRETCHES` (the request
    then runs unsteered)."""
    gate = wire["gate"]
    own = read_entries(wire["steer"])
    gated = read_entries(gate["steer"]) if gate is not None else []
    spans = [steered(e.positions, e.phase, prompt_len, END) for e in (*own, *gated)]
    points = sorted({0, prompt_len, *(x for s in spans for span in s for x in span)} - {END})
    found: list[tuple[int, str, tuple[int, ...]]] = []
    for start in points:
        active = tuple(i for i, s in enumerate(spans) if any(a <= start < b for a, b in s))
        phase = "prefill" if start < prompt_len else "decode"
        if not found or found[-1][1:] != (phase, active):
            found.append((start, phase, active))
    if len(found) > MAX_STRETCHES:  # a session's entries added to a request's own
        raise ValueError(f"{len(found)} stretches of positions, more than {MAX_STRETCHES}")
    out = []
    for start, phase, active in found:
        key = f"{wire['key']}|p{','.join(map(str, active))}"
        part = {**wire, "key": key,
                "steer": [_everywhere(own[i]) for i in active if i < len(own)]}
        if gate is not None:
            part["gate"] = {**gate, "steer": [_everywhere(gated[i - len(own)])
                                              for i in active if i >= len(own)]}
        out.append(Stretch(start=start, phase=phase, key=key, resolved=resolve(part)))
    return out


def _everywhere(entry: WireEntry) -> list[Any]:
    """The entry as it acts inside a stretch: every position (the stretch chose them)."""
    return list(entry._replace(phase="all", positions=None))
