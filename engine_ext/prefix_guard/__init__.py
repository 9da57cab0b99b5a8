"""Prefix-cache guard: which blocks of a steered request may be shared, and from where.

KV computed under steering encodes the steering, so it must never be served to a request that
would have computed it differently. The frontend gives each steered request a
:class:`CacheGuard` (carried to the scheduler in ``SamplingParams.extra_args``):

* ``key`` forks the request's block hashes from the block holding position ``fork`` on: the
  first position any static (or gated) entry steers. Earlier blocks hash as unsteered and stay
  shared with everyone; vLLM chains block hashes, so every later block is forked too.
  Prefill/all-phase static steering forks at 0; decode-only static steering forks at the
  prompt length, leaving the prompt's blocks shared.
* Gated requests are keyed by their gate too: a gate's value at a position is a function of
  the tokens up to it and of what the key covers (probe, threshold, sharpness, vectors, global
  steering, registry generation), so their blocks are cached like static ones and served to
  requests with the same key (a conversation's next turn, a shared system prompt), never to
  one with another gate or none.
* ``withhold`` (a gate under a controller, whose decisions follow step boundaries and
  chunking, not only the prefix): the scheduler caches a block only once the workers reported
  that none of its positions got a dynamic contribution (gate above
  :data:`.guard.DYNAMIC_EPSILON`); from the first such position on, blocks are never cached.
  Caching happens when a report arrives, never ahead of it, so async scheduling (the next step
  scheduled before this one's output is processed) cannot expose a block early.

The workers' report is :class:`.report.CleanPrefixReport`'s (made each step from the gate
statistics' snapshot, with :func:`.guard.grown_frontiers`):
``{request id: (positions processed, first dynamically steered position or None)}``. Any source
of dynamic steering (a later controller) plugs in by producing the same report.

The guard in one place: :mod:`.guard` (the guard, its hash key and frontier, the counters),
:mod:`.key` (what a request's guard is, computed by the frontend at admission),
:mod:`.report` (the workers' report of each step),
:mod:`.scheduler` (the state machine the engine core runs per request). The adapter
(:mod:`dynsteer.engine_ext.compat.scheduler`) only calls them at vLLM's decision points.
"""

