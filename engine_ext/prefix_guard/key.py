"""What a request's guard is: computed once by the frontend when the request is admitted."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from dynsteer.controller.positions import END, steered
from dynsteer.controller.wire import RawEntry, fingerprint, read_entries

from .guard import CacheGuard


def guard_for(wire: dict[str, Any] | None, global_wire: Sequence[RawEntry],
              global_key: str | None, registry_generation: int,
              prompt_len: int, own_from: int | None = None) -> CacheGuard | None:
    """How a request's blocks may be shared (None: unsteered, share everything).

    ``wire`` is the request's resolved spec. The key covers everything that changes the
    request's KV: its spec (vectors by their bytes), the global steering and the registry
    generation (named vectors/probes may have changed). With phase-specific entries, or
    entries that name positions (negative ones and generated-token offsets count from the end
    of the prompt), a position's KV also depends on the prompt's length, so it joins the key.
    Blocks before the first steered position are shared with everyone.

    A gate's value at a position is a function of the tokens up to it and of what the key
    covers, so gated blocks are cached under the key like static ones and served to requests
    with the same key (a later turn resending the conversation, a shared system prompt). Only
    a controller makes steering depend on more than the prefix (its decisions follow step
    boundaries and chunking): its request's blocks are withheld from the first dynamically
    steered position on (``withhold``).

    ``own_from``: the first prompt position the request captures (it must compute it, not
    take it from the cache): its blocks from there on get a key of their own.
    """
    own = wire["steer"] if wire else []
    gate = wire["gate"] if wire else None
    static = [e for e in read_entries((*global_wire, *own)) if e.scale != 0]
    # Each entry's first steered position; a generated one counts as the prompt's end (a later
    # turn's prompt holds the generated tokens).
    firsts = [min(spans[0][0], prompt_len) for e in static
              if (spans := steered(e.positions, e.phase, prompt_len, END))]
    fork: int | None = 0 if gate is not None else min(firsts, default=None)
    unique = ({"own_from": own_from, "own": secrets.token_hex(16)}
              if own_from is not None else {})
    if fork is None:
        return CacheGuard(**unique) if unique else None
    entries = [*global_wire, *own, *(gate["steer"] if gate is not None else [])]
    phase_specific = any(e.phase != "all" or e.positions is not None
                         for e in read_entries(entries))
    key = fingerprint(wire["key"] if wire else "-", global_key or "-", registry_generation,
                      prompt_len if phase_specific else -1)
    controlled = gate is not None and wire is not None and wire.get("controller") is not None
    return CacheGuard(key=key.hex(), fork=fork, withhold=controlled, **unique)
