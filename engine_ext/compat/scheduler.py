"""vLLM's engine core: where the prefix-cache guard meets the scheduler and the KV cache.

dynsteer's guard (:mod:`dynsteer.engine_ext.prefix_guard`) decides; this module only calls it
at vLLM's decision points:

* ``kv_cache_utils.generate_block_hash_extra_keys``: a block's extra hash key (steered blocks
  fork from unsteered ones);
* the KV-cache coordinator's ``cache_blocks`` (an instance attribute of each scheduler's
  coordinator, set only while a request whose blocks are withheld is live, so plain and static
  traffic pay nothing per request per step; on the instance, so a subclass's own
  ``cache_blocks``, e.g. vLLM 0.26's hybrid coordinator, is covered too): how many computed
  tokens may be cached now;
* ``KVCacheManager.free``: a request's blocks leave (count what was withheld);
* ``Scheduler.update_from_output``: the workers' report (:data:`REPORT_ATTR` on the step's
  ``ModelRunnerOutput``) advances requests' cacheable frontiers;
* ``Scheduler.add_request`` / ``_free_request``: a request whose blocks are withheld arrives
  and leaves (the coordinator hook above is set and removed);
* ``Scheduler.schedule`` / ``_free_request``: waiting requests whose steering rows would not
  fit stay queued this step (:mod:`dynsteer.engine_ext.row_budget` decides), scheduled ones
  hold their rows until freed;
* ``EngineCore.dynsteer_cache_stats``: a utility call returning the guard's counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .patching import patch, when_imported

REPORT_ATTR = "dynsteer_cache_report"
"""Attribute of the workers' ``ModelRunnerOutput`` that carries the guard report:
``{request id: (positions processed, first dynamically steered position or None)}``."""
STATS_UTILITY = "dynsteer_cache_stats"
"""Name of the engine-core utility method returning the guard's counters."""
_GUARD_ATTR = "_dynsteer_guard"


class RequestGuard(Protocol):
    """The guard of one request, as the scheduler calls it."""

    withhold: bool

    def extra_key(self, start: int, end: int) -> Any: ...

    def cacheable(self, num_computed: int) -> int: ...

    def freed(self, block_size: int) -> None: ...

    def reported(self, processed: int, first_dynamic: int | None,
                 num_computed: int) -> int | None: ...


class RowBudget(Protocol):
    """The steering rows of one engine core, as the scheduler calls it."""

    def plan(self, waiting: Any, slots: int) -> set[str]: ...

    def take(self, req_id: str, claims: Any) -> None: ...

    def release(self, req_id: str) -> None: ...


@dataclass(frozen=True)
class SchedulerHooks:
    """How the adapter calls dynsteer's prefix-cache guard and row budget."""

    guard_of: Callable[[dict[str, Any] | None], RequestGuard | None]
    """The guard of a request from its ``SamplingParams.extra_args`` (None: unguarded)."""
    stats: Callable[[], dict[str, int]]
    """The guard's and the budget's counters in this engine core."""
    claims_of: Callable[[dict[str, Any] | None], Any]
    """The rows a request takes, from its ``extra_args`` (None: none)."""
    budget_for: Callable[[dict[str, Any]], RowBudget | None]
    """A scheduler's row budget from the engine's ``additional_config`` (None: not enabled)."""


def install(hooks: SchedulerHooks) -> None:
    def guard(request: Any) -> RequestGuard | None:
        """Parsed once and kept on vLLM's ``Request`` (False: none)."""
        found = getattr(request, _GUARD_ATTR, None)
        if found is None:
            params = getattr(request, "sampling_params", None)
            found = hooks.guard_of(params.extra_args if params is not None else None) or False
            setattr(request, _GUARD_ATTR, found)
        return found or None

    when_imported("vllm.v1.core.kv_cache_utils", lambda m: patch(
        m, "generate_block_hash_extra_keys", lambda original: _extra_keys(guard, original)))
    when_imported("vllm.v1.core.kv_cache_manager", lambda m: patch(
        m.KVCacheManager, "free", lambda original: _free(guard, original)))
    def claims(request: Any) -> Any:
        """Parsed once and kept on vLLM's ``Request``."""
        found = getattr(request, _CLAIMS_ATTR, _UNSET)
        if found is _UNSET:
            params = getattr(request, "sampling_params", None)
            found = hooks.claims_of(params.extra_args if params is not None else None)
            setattr(request, _CLAIMS_ATTR, found)
        return found

    def budget(scheduler: Any) -> RowBudget | None:
        found = getattr(scheduler, _BUDGET_ATTR, _UNSET)
        if found is _UNSET:
            found = hooks.budget_for(dict(scheduler.vllm_config.additional_config or {}))
            setattr(scheduler, _BUDGET_ATTR, found)
        return found

    def patch_scheduler(m: Any) -> None:
        patch(m.Scheduler, "update_from_output",
              lambda original: _update_from_output(guard, original))
        patch(m.Scheduler, "schedule", lambda original: _schedule(budget, claims, original))
        patch(m.Scheduler, "add_request", lambda original: _add_request(guard, original))
        patch(m.Scheduler, "_free_request", lambda original: _free_request(budget, original))

    when_imported("vllm.v1.core.sched.scheduler", patch_scheduler)
    when_imported("vllm.v1.engine.core", lambda m: setattr(
        m.EngineCore, STATS_UTILITY, lambda self: hooks.stats()))


Guard = Callable[[Any], RequestGuard | None]
_CLAIMS_ATTR = "_dynsteer_claims"
_BUDGET_ATTR = "_dynsteer_row_budget"
_WITHHOLDING_ATTR = "_dynsteer_withholding"
_UNSET = object()


def _waiting_queues(scheduler: Any) -> list[Any]:
    """The queues a request waits in to be scheduled (vLLM 0.26 keeps a second one for
    requests it skipped)."""
    skipped = getattr(scheduler, "skipped_waiting", None)
    return [scheduler.waiting] if skipped is None else [scheduler.waiting, skipped]


def _schedule(budget: Callable[[Any], RowBudget | None], claims: Callable[[Any], Any],
              original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows = budget(self)
        queues = _waiting_queues(self) if rows is not None else []
        held: list[tuple[Any, list[Any]]] = []
        if any(queues):
            slots = self.max_num_running_reqs - len(self.running)
            ids = rows.plan(((r.request_id, claims(r)) for q in queues for r in q), slots)
            for queue in queues if ids else ():
                mine = [r for r in queue if r.request_id in ids]
                if mine:
                    queue.remove_requests(mine)
                    held.append((queue, mine))
        try:
            output = original(self, *args, **kwargs)
        finally:
            for queue, mine in held:  # back in front, in their order
                for request in reversed(mine):
                    queue.prepend_request(request)
        if rows is not None:
            for new in output.scheduled_new_reqs:
                request = self.requests.get(new.req_id)
                rows.take(new.req_id, claims(request) if request is not None else None)
        return output

    return schedule


class _Withholding:
    """The live requests of one scheduler whose blocks the guard withholds. While there is
    one, the scheduler's KV-cache coordinator caches through the guard (its ``cache_blocks``,
    called per scheduled request per step, is shadowed by an instance attribute); while there
    is none, vLLM's own method runs, unwrapped."""

    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator
        self._guards: dict[str, RequestGuard] = {}
        self._guarded = _cache_blocks(self._guards, coordinator.cache_blocks)

    def add(self, req_id: str, guard: RequestGuard) -> None:
        if not self._guards:
            self._coordinator.cache_blocks = self._guarded
        self._guards[req_id] = guard

    def discard(self, req_id: str) -> None:
        if self._guards.pop(req_id, None) is not None and not self._guards:
            del self._coordinator.cache_blocks


def _withholding(scheduler: Any) -> _Withholding:
    found = getattr(scheduler, _WITHHOLDING_ATTR, None)
    if found is None:
        found = _Withholding(scheduler.kv_cache_manager.coordinator)
        setattr(scheduler, _WITHHOLDING_ATTR, found)
    return found


def _add_request(guard: Guard, original: Callable[..., Any]) -> Callable[..., Any]:
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        found = guard(request)
        if found is not None and found.withhold:
            _withholding(self).add(request.request_id, found)
        return original(self, request, *args, **kwargs)

    return add_request


def _free_request(budget: Callable[[Any], RowBudget | None],
                  original: Callable[..., Any]) -> Callable[..., Any]:
    def free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        rows = budget(self)
        if rows is not None:
            rows.release(request.request_id)
        result = original(self, request, *args, **kwargs)
        withholding = getattr(self, _WITHHOLDING_ATTR, None)
        if withholding is not None:  # after vLLM freed (and maybe cached) its blocks
            withholding.discard(request.request_id)
        return result

    return free_request


def _extra_keys(guard: Guard, original: Callable[..., Any]) -> Callable[..., Any]:
    def generate_block_hash_extra_keys(request: Any, start: int, end: int, *args: Any,
                                       **kwargs: Any) -> Any:
        keys, next_mm = original(request, start, end, *args, **kwargs)
        found = guard(request)
        extra = found.extra_key(start, end) if found is not None else None
        if extra is not None:
            keys = (*(keys or ()), extra)
        return keys, next_mm

    return generate_block_hash_extra_keys


def _cache_blocks(guards: dict[str, RequestGuard],
                  original: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    """A coordinator's bound ``cache_blocks`` that caches a withheld request's blocks only
    up to its clean frontier (``guards``: the withheld requests' guards by id).

    vLLM calls it for every scheduled request in every step, so it is one dict look-up and
    the call, with ``cache_blocks``' own two positional parameters (both supported versions):
    a plain request's call costs about 170 ns on a CPU machine, against 65 ns for vLLM's
    method alone (forwarding ``*args, **kwargs`` instead would cost about 390 ns)."""

    def cache_blocks(request: Any, num_computed_tokens: int) -> Any:
        found = guards.get(request.request_id)
        if found is not None:
            num_computed_tokens = found.cacheable(num_computed_tokens)
        return original(request, num_computed_tokens)

    return cache_blocks


def _free(guard: Guard, original: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        found = guard(request)
        if found is not None and found.withhold:
            found.freed(self.coordinator.scheduler_block_size)
        return original(self, request, *args, **kwargs)

    return free


def _update_from_output(guard: Guard, original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any,
                           *args: Any, **kwargs: Any) -> Any:
        report = getattr(model_runner_output, REPORT_ATTR, None)
        if report:  # before the original: it frees requests that finish in this step
            _apply_report(self, guard, report)
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    return update_from_output


def _apply_report(scheduler: Any, guard: Guard, report: dict[str, Any]) -> None:
    for req_id, (processed, first_dynamic) in report.items():
        request = scheduler.requests.get(req_id)
        found = guard(request) if request is not None else None
        if found is None or not found.withhold:
            continue
        clean = found.reported(processed, first_dynamic, request.num_computed_tokens)
        if clean is not None:
            scheduler.kv_cache_manager.cache_blocks(request, clean)
