"""Token positions a request names: which of the positions the engine computes it wants.

A request of ``P`` prompt tokens that generates ``G`` tokens has positions ``0 .. P + G - 2``
computed by the engine: the prompt and every generated token but the last (whose forward never
runs). A selection names some of them:

* ``"prompt"``: ``0 .. P - 1``; ``"generated"``: ``P .. P + G - 2``; ``"all"``: both;
  ``"last_prompt"``: ``P - 1``;
* a list of integers and ranges: ``5`` is position 5, ``-1`` the last prompt token (negative
  indices count from the end of the prompt), ``"a:b"`` positions ``a`` to ``b - 1`` with the
  same rules for ``a`` and ``b``, either of which may be left out (``":4"``, ``"-3:"``: an open
  end runs to the last computed position).

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

RANGE_PATTERN = r"^-?\d{0,9}:-?\d{0,9}$"
Range = Annotated[str, StringConstraints(pattern=RANGE_PATTERN)]
"""``"a:b"``: ``a`` up to (not including) ``b``, either end optional."""
Index = Annotated[int, Field(strict=True, ge=-(2**31), lt=2**31)]

Positions = Named | Annotated[list[Index | Range], Field(min_length=1, max_length=MAX_ITEMS)]
"""What a request names (see the module docstring)."""


def _absolute(index: int, prompt_len: int) -> int:
    return index + prompt_len if index < 0 else index


def select(positions: Positions, prompt_len: int, computed: int) -> np.ndarray:
    """The positions named, sorted and unique, among ``0 .. computed - 1`` (int64)."""
    every = np.arange(computed, dtype=np.int64)
    if positions == "all":
        return every
    if positions == "prompt":
        return every[:prompt_len]
    if positions == "generated":
        return every[prompt_len:]
    if positions == "last_prompt":
        return every[prompt_len - 1:prompt_len] if prompt_len > 0 else every[:0]
    wanted = np.zeros(computed, dtype=bool)
    for item in positions:
        if isinstance(item, str):
            start_text, _, stop_text = item.partition(":")
            start = _absolute(int(start_text), prompt_len) if start_text else 0
            stop = _absolute(int(stop_text), prompt_len) if stop_text else computed
            wanted[max(start, 0):max(stop, 0)] = True
        else:
            position = _absolute(item, prompt_len)
            if 0 <= position < computed:
                wanted[position] = True
    return np.flatnonzero(wanted).astype(np.int64)


def first_prompt_position(positions: Positions, prompt_len: int) -> int | None:
    """The lowest prompt position the selection may name (None: no prompt position)."""
    if positions in ("all", "prompt"):
        return 0 if prompt_len > 0 else None
    if positions == "generated":
        return None
    if positions == "last_prompt":
        return prompt_len - 1 if prompt_len > 0 else None
    lowest = None
    for item in positions:
        if isinstance(item, str):
            start_text = item.partition(":")[0]
            start = max(_absolute(int(start_text), prompt_len), 0) if start_text else 0
        else:
            start = _absolute(item, prompt_len)
            if start < 0:
                continue
        lowest = start if lowest is None else min(lowest, start)
    return lowest if lowest is not None and lowest < prompt_len else None
