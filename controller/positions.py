"""Token positions a request names: for capture, which of the positions the engine computes it
wants; for a steering entry, which positions it steers.

A request of ``P`` prompt tokens that generates ``G`` tokens has positions ``0 .. P + G - 2``
computed by the engine: the prompt and every generated token but the last (whose forward never
runs). A selection names some of them:

* ``"prompt"``: ``0 .. P - 1``; ``"generated"``: ``P`` on; ``"all"``: both;
  ``"last_prompt"``: ``P - 1``;
* a list of integers and ranges: ``5`` is position 5, ``-1`` the last prompt token (negative
  indices count from the end of the prompt), ``"g0"`` the first generated token's position
  (``P``; ``"gK"`` is ``P + K``), ``"a:b"`` positions ``a`` to ``b - 1`` where ``a`` and
  ``b`` take the same forms (``"g2:g6"``, ``"-3:"``), either of which may be left out (an open
  end runs from 0 or to the last position).

Positions past the last computed one are not there (a request that stopped early); the
selection is the sorted set of the named positions that exist. No vLLM import.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, StringConstraints

Named = Literal["prompt", "generated", "all", "last_prompt"]
NAMED: tuple[Named, ...] = ("prompt", "generated", "all", "last_prompt")

MAX_ITEMS = 1024
"""Most items in one list of positions."""

_END = r"(?:-?\d{1,9}|g\d{1,9})?"
RANGE_PATTERN = rf"^(?:g\d{{1,9}}|{_END}:{_END})$"
Range = Annotated[str, StringConstraints(pattern=RANGE_PATTERN)]
"""``"gK"`` (generated token ``K``) or ``"a:b"``: ``a`` up to (not including) ``b``, either end
optional."""
Index = Annotated[int, Field(strict=True, ge=-(2**31), lt=2**31)]

Positions = Named | Annotated[list[Index | Range], Field(min_length=1, max_length=MAX_ITEMS)]
"""What a request names (see the module docstring)."""


def _absolute(text: str | int, prompt_len: int) -> int:
    """One end or index as an absolute position (may be negative: before the prompt)."""
    if isinstance(text, str) and text.startswith("g"):
        return prompt_len + int(text[1:])
    index = int(text)
    return index + prompt_len if index < 0 else index


def intervals(positions: Positions, prompt_len: int, end: int) -> list[tuple[int, int]]:
    """The positions named among ``0 .. end - 1``, as sorted, disjoint, non-adjacent half-open
    intervals ``[a, b)``."""
    if positions == "all":
        spans = [(0, end)]
    elif positions == "prompt":
        spans = [(0, prompt_len)]
    elif positions == "generated":
        spans = [(prompt_len, end)]
    elif positions == "last_prompt":
        spans = [(prompt_len - 1, prompt_len)] if prompt_len > 0 else []
    else:
        spans = []
        for item in positions:
            if isinstance(item, str) and ":" in item:
                start_text, _, stop_text = item.partition(":")
                spans.append((_absolute(start_text, prompt_len) if start_text else 0,
                              _absolute(stop_text, prompt_len) if stop_text else end))
            else:
                position = _absolute(item, prompt_len)
                spans.append((position, position + 1))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted((max(a, 0), min(b, end)) for a, b in spans):
        if start >= stop:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def steered(positions: Positions | None, phase: str, prompt_len: int, end: int
            ) -> list[tuple[int, int]]:
    """The positions a steering entry steers, as :func:`intervals` gives them: its
    ``positions`` (None: every one) within its ``phase`` (``all``, ``prefill``: the prompt,
    ``decode``: the generated tokens)."""
    low, high = {"all": (0, end), "prefill": (0, prompt_len), "decode": (prompt_len, end)}[phase]
    named = positions if positions is not None else "all"
    return [(max(a, low), min(b, high)) for a, b in intervals(named, prompt_len, end)
            if max(a, low) < min(b, high)]


END = 2**31 - 1
"""Past every position a request can reach (the open end of a steering entry's positions)."""

MAX_CUTS = 64
"""Most points, over a request's steering entries, where the set of entries that steer a
position may change (each item of ``positions`` gives at most two): every stretch between two
of them takes a steering row of its own on the workers."""


def cuts(positions: Positions | None) -> int:
    """At most how many such points ``positions`` adds (besides the end of the prompt)."""
    if positions is None or positions in ("all", "generated", "prompt"):
        return 0
    if positions == "last_prompt":
        return 1
    return 2 * len(positions)


def select(positions: Positions, prompt_len: int, computed: int) -> np.ndarray:
    """The positions named, sorted and unique, among ``0 .. computed - 1`` (int64)."""
    spans = intervals(positions, prompt_len, computed)
    if not spans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])


def first_prompt_position(positions: Positions, prompt_len: int) -> int | None:
    """The lowest prompt position the selection may name (None: no prompt position)."""
    spans = intervals(positions, prompt_len, prompt_len)
    return spans[0][0] if spans else None
