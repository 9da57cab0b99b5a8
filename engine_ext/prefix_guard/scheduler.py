"""The guard's state machine on the scheduler, one :class:`GuardedRequest` per steered request.

The adapter (:mod:`dynsteer.engine_ext.compat.scheduler`) calls it at vLLM's decision points;
this module decides. A withheld request's blocks (a gate under a controller) are cached only
up to its *clean frontier*: the positions the workers reported processed with no dynamic
contribution (:func:`.guard.frontier`).
"""

from __future__ import annotations

from typing import Any

from dynsteer.controller.extra_args import GUARD_KEY

from .guard import STATS, CacheGuard, fork_keys, frontier


class GuardedRequest:
    """One request's guard and how far its blocks may be cached."""

    __slots__ = ("frontier", "guard", "wanted")

    def __init__(self, guard: CacheGuard) -> None:
        self.guard = guard
        self.frontier = 0
        """Positions reported clean (cacheable)."""
        self.wanted = 0
        """Most positions vLLM asked to cache (what withholding cost, counted on free)."""

    @property
    def withhold(self) -> bool:
        return self.guard.withhold

    def extra_key(self, start: int, end: int) -> tuple[str, ...] | None:
        """The extra hash key of the block ``[start, end)``."""
        return fork_keys(self.guard, start, end)

    def cacheable(self, num_computed: int) -> int:
        """How many of ``num_computed`` tokens may be cached now."""
        self.wanted = max(self.wanted, num_computed)
        return min(num_computed, self.frontier)

    def freed(self, block_size: int) -> None:
        """The request's blocks leave: count full blocks never cached."""
        STATS.blocks_withheld += max(0, self.wanted // block_size - self.frontier // block_size)
        self.wanted = 0  # a preempted request counts again when resumed

    def reported(self, processed: int, first_dynamic: int | None,
                 num_computed: int) -> int | None:
        """The workers' report: the new frontier when it grew (cache up to it), else None."""
        STATS.reports += 1
        clean = min(frontier(processed, first_dynamic), num_computed)
        if clean <= self.frontier:
            return None
        self.frontier = clean
        return clean


def guard_of(extra_args: dict[str, Any] | None) -> GuardedRequest | None:
    """A request's guard from what the frontend wrote into its ``extra_args``."""
    raw = extra_args.get(GUARD_KEY) if extra_args else None
    if not isinstance(raw, dict):
        return None
    guard = CacheGuard.model_validate(raw)
    if guard.withhold:
        STATS.guarded_requests += 1
    return GuardedRequest(guard)


def stats() -> dict[str, int]:
    """This engine core's counters (exported as metrics)."""
    return dict(vars(STATS))
