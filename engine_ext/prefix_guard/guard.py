"""The guard of one request, its block keys and frontier, and the guard's counters."""


from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

DYNAMIC_EPSILON = 1e-3
"""A position's KV counts as dynamically steered when its gate is above this (and the gate
steers that position's phase): below it the gated entries add under 0.1% of their vector, so
the KV is treated as unsteered and stays shareable through the prefix cache."""
NONE = np.iinfo(np.int64).max
"""Sentinel of position arrays: no such position (yet)."""


class CacheGuard(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = None
    """Fingerprint of everything that changes this request's KV (None: nothing steers it)."""
    fork: int | None = Field(default=None, ge=0)
    """First steered position: blocks from the one holding it on hash under ``key``."""
    withhold: bool = False
    """Cache blocks only below the reported first dynamically steered position."""
    own_from: int | None = Field(default=None, ge=0)
    """First prompt position this request must compute itself (it captures it): blocks from
    the one holding it on hash under ``own`` too, so no earlier request's blocks match them."""
    own: str | None = None
    """A key no other request has (set with ``own_from``)."""


def fork_keys(guard: CacheGuard, start: int, end: int) -> tuple[str, ...] | None:
    """The extra hash key of the block ``[start, end)``, None where the hash stays as vLLM
    makes it (a block's hash chains its predecessors', so one fork changes every later one)."""
    keys: tuple[str, ...] = ()
    if guard.fork is not None and start <= guard.fork < end:
        keys = ("dynsteer", guard.key or "-")
    if guard.own_from is not None and start <= guard.own_from < end:
        keys = (*keys, "dynsteer-own", guard.own or "-")
    return keys or None


def frontier(processed: int, first_dynamic: int | None) -> int:
    """Positions below this may be cached: all processed ones until one is dynamically steered."""
    return processed if first_dynamic is None else min(processed, first_dynamic)


def grown_frontiers(processed: np.ndarray, first_dynamic: np.ndarray,
                    reported_blocks: np.ndarray, block_size: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The workers' side of :func:`frontier`, for all request slots at once: the slots whose
    frontier grew by a whole block past ``reported_blocks``, and every slot's frontier in
    whole blocks (the caller records those of the slots it reports). ``first_dynamic``
    holds :data:`NONE` where no position was dynamically steered."""
    blocks = np.minimum(processed, first_dynamic) // block_size
    return np.flatnonzero(blocks > reported_blocks), blocks


@dataclass
class GuardStats:
    """Counters of the scheduler side (exported as metrics)."""

    guarded_requests: int = 0
    """Requests whose blocks were withheld until reported clean."""
    reports: int = 0
    """Per-request reports received from the workers."""
    blocks_withheld: int = 0
    """Full blocks never cached because they hold dynamically steered (or unreported) KV."""


STATS = GuardStats()
"""This engine-core process's counters."""
