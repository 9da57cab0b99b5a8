"""Prefix-cache guard: which blocks of a steered request may be shared, and from where.

KV computed under steering encodes the steering, so it must never be served to a request that
would have computed it differently. The frontend gives each steered request a
:class:`CacheGuard` (carried to the scheduler in ``SamplingParams.extra_args``):

* ``key`` forks the request's block hashes from the block holding position ``fork`` on: the
  first position any static (or gated) entry steers. Earlier blocks hash as unsteered and stay
  shared with everyone; vLLM chains block hashes, so every later block is forked too.
  Prefill/all-phase static steering forks at 0; decode-only static steering forks at the
  prompt length, leaving the prompt's blocks shared.
* ``withhold`` (gated requests): the scheduler caches a block only once the workers reported
  that none of its positions got a dynamic contribution (gate above
  :data:`~dynsteer.engine_ext.telemetry.DYNAMIC_EPSILON`); from the first such position on,
  blocks are never cached. Caching happens when a report arrives, never ahead of it, so async
  scheduling (the next step scheduled before this one's output is processed) cannot expose a
  block early. Gated requests are keyed by their gate too: reading another request's blocks
  would skip their own gate's evaluation at those positions.

The workers' report is :meth:`~dynsteer.engine_ext.telemetry.GateTelemetry.cache_report`:
``{request id: (positions processed, first dynamically steered position or None)}``. Any source
of dynamic steering (a later controller) plugs in by producing the same report.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

GUARD_KEY = "dynsteer_cache"
"""Key of the guard in ``SamplingParams.extra_args`` (set by the frontend, read by the
scheduler; a client-supplied value is overwritten)."""
REPORT_ATTR = "dynsteer_cache_report"
"""Attribute of the workers' ``ModelRunnerOutput`` that carries the report to the scheduler."""


class CacheGuard(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    """Fingerprint of everything that changes this request's KV."""
    fork: int = Field(ge=0)
    """First steered position: blocks from the one holding it on hash under ``key``."""
    withhold: bool = False
    """Cache blocks only below the reported first dynamically steered position."""


def fork_keys(guard: CacheGuard, start: int, end: int) -> tuple[str, str] | None:
    """The extra hash key of the block ``[start, end)``, None where the hash stays unsteered."""
    return ("dynsteer", guard.key) if start <= guard.fork < end else None


def frontier(processed: int, first_dynamic: int | None) -> int:
    """Positions below this may be cached: all processed ones until one is dynamically steered."""
    return processed if first_dynamic is None else min(processed, first_dynamic)


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
