"""vLLM's model runners and workers.

* ``load_model`` of each runner class: dynsteer attaches once the model exists, before the
  first forward (the profile run is the first trace).
* Per-step hooks, installed on the runner *instance* only when dynsteer attaches:
  V1 (``GPUModelRunner`` / ``CPUModelRunner``): ``_update_states`` + ``_prepare_inputs``;
  V2 (``vllm.v1.worker.gpu.model_runner``): ``add_requests`` + ``_remove_request`` +
  ``prepare_inputs``; both: ``sample_tokens``, whose output carries the prefix-guard report to
  the scheduler (:data:`.scheduler.REPORT_ATTR`).
* The worker extension (``worker_extension_cls``) reaches its runner and rank here.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .patching import patch, when_imported
from .scheduler import REPORT_ATTR

_RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)


def install(on_model_loaded: Callable[[Any, dict[str, Any]], None]) -> None:
    """Call ``on_model_loaded(runner, additional_config)`` after every runner's ``load_model``
    (patched when, if ever, the runner's module is imported)."""
    for module, cls_name in _RUNNERS:
        when_imported(module, lambda mod, c=cls_name: patch(
            getattr(mod, c), "load_model", functools.partial(_load_model, on_model_loaded)))


def _load_model(on_model_loaded: Callable[[Any, dict[str, Any]], None],
                original: Callable[..., Any]) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        on_model_loaded(self, dict(self.vllm_config.additional_config or {}))
        return result

    return load_model


@dataclass(frozen=True)
class RunnerFacts:
    """What a worker's steering state needs to know about its runner."""

    model: Any
    """The loaded ``nn.Module``."""
    hidden_size: int
    num_layers: int
    """Decoder layers of the whole model (all pipeline stages)."""
    max_tokens: int
    """Largest token count a forward can see (batched tokens or a padded CUDA-graph size)."""
    max_requests: int
    block_size: int
    """Tokens per KV-cache block (the prefix cache shares whole blocks)."""
    device: Any
    norm_passes: tuple[str, ...] = ()
    """vLLM's compile passes on in this engine that fuse an RMSNorm with what is around it
    (:func:`norm_passes`)."""


NORM_PASSES = ("fuse_norm_quant", "fuse_allreduce_rms", "enable_sp", "fuse_act_padding")
"""vLLM 0.26 / 0.32 ``PassConfig`` flags whose passes pattern-match the add + RMSNorm (with a
quantization, a tensor-parallel all-reduce, sequence parallelism, padding). A norm replaced by
``dynsteer::steer_norm`` no longer matches, so a site keeps out of the norm's kernel where
one is on (engine option ``fused_norms``): e.g. under tensor parallelism on Hopper with
FlashInfer, where vLLM's optimization level 2 fuses the all-reduce into the norm."""


def norm_passes(pass_config: Any) -> tuple[str, ...]:
    """The :data:`NORM_PASSES` on in ``pass_config`` (flags a version lacks count as off)."""
    return tuple(name for name in NORM_PASSES if getattr(pass_config, name, False))


def runner_facts(runner: Any) -> RunnerFacts:
    config = runner.vllm_config
    capture = config.compilation_config.max_cudagraph_capture_size or 0
    return RunnerFacts(
        model=runner.get_model(),
        hidden_size=config.model_config.get_hidden_size(),
        num_layers=config.model_config.get_total_num_hidden_layers(),
        max_tokens=max(runner.max_num_tokens, capture),
        max_requests=config.scheduler_config.max_num_seqs,
        block_size=int(config.cache_config.block_size),
        device=runner.device,
        norm_passes=norm_passes(config.compilation_config.pass_config),
    )


STATE_ATTR = "dynsteer_state"
"""Attribute of the model runner holding dynsteer's worker state."""


def runner_state(runner: Any) -> Any:
    return getattr(runner, STATE_ATTR, None)


def set_runner_state(runner: Any, state: Any) -> None:
    setattr(runner, STATE_ATTR, state)


def worker_state(worker: Any) -> Any:
    """dynsteer's state on a worker (the extension's ``self``), None before the model loads."""
    return runner_state(worker.model_runner)


def replies(worker: Any) -> bool:
    """Whether this worker is TP rank 0 of its pipeline stage.

    vLLM's executors set ``is_driver_worker`` exactly when ``rank % tp_size == 0``
    (multiproc, Ray; the single-process executor has one worker, the driver).
    """
    return bool(getattr(worker, "is_driver_worker", True))


def stage_buffers(runner: Any) -> Any:
    """The persistent buffers a pipeline stage receives the previous stage's tensors into,
    where the runner made them when it loaded the model (V2 runner; None elsewhere)."""
    return getattr(runner, "intermediate_tensors", None)


def is_output_rank() -> bool:
    """Whether this worker's output is the one the scheduler sees: TP rank 0 of the last
    pipeline stage (the one that publishes controller events)."""
    from vllm.distributed import get_pp_group, get_tp_group

    return get_tp_group().rank_in_group == 0 and bool(get_pp_group().is_last_rank)


def caller_id(internal_id: str) -> str:
    """The caller's request id of the engine's ``internal_id`` (see :func:`is_internal_id_of`)."""
    head, dash, tail = internal_id.rpartition("-")
    return head if dash and len(tail) == 8 and tail.isalnum() else internal_id


def sink_writer() -> tuple[int, int] | None:
    """(pipeline stage, stages) when this worker is TP rank 0 of its stage (it writes the
    engine's capture sinks), else None."""
    from vllm.distributed import get_pp_group, get_tp_group

    if get_tp_group().rank_in_group != 0:
        return None
    pp = get_pp_group()
    return int(pp.rank_in_group), int(pp.world_size)


def is_internal_id_of(internal_id: str, request_id: str) -> bool:
    """Whether the engine's ``internal_id`` belongs to the caller's ``request_id``: vLLM
    appends ``-`` and 8 random characters to the latter."""
    prefix = request_id + "-"
    return internal_id.startswith(prefix) and len(internal_id) == len(prefix) + 8


class BatchBuffers(NamedTuple):
    """The V2 runner's persistent device buffers of each step's batch (rewritten in place
    every step): ``query_start_loc`` (``int32[max_reqs + 1]``: request ``b`` of the batch owns
    tokens ``[q[b], q[b + 1])``, entries past the batch hold the step's token count) and
    ``positions`` (``int64[max_tokens]``)."""

    query_start_loc: Any
    positions: Any


def batch_buffers(runner: Any) -> BatchBuffers | None:
    """The runner's :class:`BatchBuffers`: the V2 runner on CUDA (None elsewhere)."""
    buffers = getattr(runner, "input_buffers", None)
    if not is_v2_runner(runner) or buffers is None or runner.device.type != "cuda":
        return None
    if buffers.positions.dim() != 1:
        return None
    return BatchBuffers(buffers.query_start_loc, buffers.positions)


def _step_slots(runner: Any, batch: Any) -> Any:
    """The batch's request slots on the device, when its ``query_start_loc`` and
    ``positions`` are the views of the runner's persistent buffers (from their start) that
    :func:`batch_buffers` hands out; else None (the host fills the index)."""
    buffers = runner.input_buffers
    if (batch.query_start_loc.data_ptr() != buffers.query_start_loc.data_ptr()
            or batch.positions.data_ptr() != buffers.positions.data_ptr()):
        return None
    return batch.idx_mapping


def is_v2_runner(runner: Any) -> bool:
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def install_step_hooks(runner: Any, on_add: Callable[..., None],
                       on_remove: Callable[[str, bool], None],
                       on_step: Callable[..., None], on_output: Callable[[], dict[str, Any]],
                       on_idle: Callable[[], None],
                       on_updated: Callable[[bool], None]) -> None:
    """Hook the runner instance so the state sees admissions, removals and each step.

    ``on_add(req_id, slot_or_None, extra_args, prompt_len)`` (V1 passes None: the caller
    picks a slot), ``on_remove(req_id)``, ``on_step(req_ids, slots_or_None, num_computed,
    num_scheduled, device_slots_or_None)`` (the slots as a device tensor: V2 on CUDA, see
    :func:`batch_buffers`);
    ``on_output()`` returns the prefix-guard report that rides on the step's
    ``ModelRunnerOutput`` to the scheduler. ``on_idle()`` runs before every forward the
    scheduler did not schedule (``_dummy_run``: a data-parallel rank's idle batch, which the
    other ranks' MoE collectives need, warm-up, graph capture): no real request's tokens are
    in it, so nothing may be read for them. ``on_updated(empty)`` runs once a step's
    removals and admissions are done; ``empty``: the step schedules no token (it only tells
    the workers which requests finished), so no forward and no ``on_step`` follow.
    """
    if is_v2_runner(runner):
        _install_v2(runner, on_add, on_remove, on_step, on_updated)
    else:
        _install_v1(runner, on_add, on_remove, on_step, on_updated)
    sample_tokens = runner.sample_tokens
    dummy_run = runner._dummy_run

    def _sample_tokens(*args: Any, **kwargs: Any) -> Any:
        return _attach_report(sample_tokens(*args, **kwargs), on_output())

    def _dummy_run(*args: Any, **kwargs: Any) -> Any:
        on_idle()
        return dummy_run(*args, **kwargs)

    runner.sample_tokens = _sample_tokens
    runner._dummy_run = _dummy_run


def _attach_report(result: Any, report: dict[str, Any]) -> Any:
    """``result`` (a ModelRunnerOutput, or an async one that makes it later) carrying
    ``report``; a shallow copy, since vLLM reuses shared empty outputs."""
    if not report or result is None:
        return result
    if hasattr(result, "get_output"):
        get_output = result.get_output
        result.get_output = lambda: _attach_report(get_output(), report)
        return result
    if hasattr(result, "sampled_token_ids"):
        result = copy.copy(result)
        setattr(result, REPORT_ATTR, report)
    return result


def _install_v1(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str, bool], None],
                on_step: Callable[..., None], on_updated: Callable[[bool], None]) -> None:
    update_states = runner._update_states
    prepare_inputs = runner._prepare_inputs

    def _update_states(scheduler_output: Any) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            on_remove(req_id, True)
        result = update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            req = runner.requests[new.req_id]
            on_add(new.req_id, None, params.extra_args if params else None, req.num_prompt_tokens)
        on_updated(scheduler_output.total_num_scheduled_tokens == 0)
        return result

    def _prepare_inputs(scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = runner.input_batch
        n = batch.num_reqs
        on_step(batch.req_ids[:n], None, batch.num_computed_tokens_cpu[:n], num_scheduled_tokens,
                None)
        return result

    runner._update_states = _update_states
    runner._prepare_inputs = _prepare_inputs


def _install_v2(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str, bool], None],
                on_step: Callable[..., None], on_updated: Callable[[bool], None]) -> None:
    add_requests = runner.add_requests
    remove_request = runner._remove_request
    finish_requests = getattr(runner, "finish_requests", None)
    prepare_inputs = runner.prepare_inputs
    finishing: set[str] = set()
    """Requests ``finish_requests`` removes because they finished (not preempted ones, nor
    re-added ones)."""

    def _add_requests(scheduler_output: Any) -> Any:
        result = add_requests(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            slot = runner.req_states.req_id_to_index[new.req_id]
            extra = params.extra_args if params else None
            on_add(new.req_id, slot, extra, len(new.prompt_token_ids))
        on_updated(scheduler_output.total_num_scheduled_tokens == 0)  # after finish_requests
        return result

    def _finish_requests(scheduler_output: Any) -> Any:
        finishing.update(set(scheduler_output.finished_req_ids)
                         - set(scheduler_output.preempted_req_ids or ()))
        try:
            return finish_requests(scheduler_output)
        finally:
            finishing.clear()

    def _remove_request(req_id: str) -> Any:
        on_remove(req_id, req_id in finishing or finish_requests is None)
        return remove_request(req_id)

    def _prepare_inputs(scheduler_output: Any, batch_desc: Any) -> Any:
        batch = prepare_inputs(scheduler_output, batch_desc)
        on_step(batch.req_ids, batch.idx_mapping_np, batch.num_computed_tokens_np,
                batch.num_scheduled_tokens, _step_slots(runner, batch))
        return batch

    runner.add_requests = _add_requests
    runner._remove_request = _remove_request
    if finish_requests is not None:
        runner.finish_requests = _finish_requests
    runner.prepare_inputs = _prepare_inputs
