"""Every access to vLLM internals, for vLLM 0.26 (GPU, V2 runner) through 0.32 (CPU, V1 runner).

The next vLLM release should be a change to this file only. What is touched, and why:

* ``EngineArgs.create_engine_config`` (frontend): normalizes ``additional_config["dynsteer"]``
  (plugin version, kernel ABI: part of vLLM's compile-cache key, so a graph compiled without the
  plugin, or with other sites, is never reused) and sets ``worker_extension_cls``.
* ``InputProcessor.process_inputs`` (frontend): rejects a bad spec at ``generate()`` / request
  time with an error naming the field (the engine never sees it; HTTP 400 on the server), and
  attaches the request's prefix-cache guard (``FrontendState.cache_guard``) to its params.
* Engine core, the prefix-cache guard (:mod:`.prefix_guard`):
  ``kv_cache_utils.generate_block_hash_extra_keys`` (fork the hashes at the first steered
  block), ``KVCacheCoordinator.cache_blocks`` (clamp gated requests to their clean frontier),
  ``Scheduler.update_from_output`` (apply the workers' report, cache newly clean blocks),
  ``KVCacheManager.free`` (count withheld blocks), ``EngineCore.dynsteer_cache_stats`` (a
  utility call for the counters).
* Model runners' ``load_model`` (workers): wraps the decoder layers once the model exists, before
  the first forward (profile run = first trace).
* Per-step hooks, installed on the runner *instance* only when the plugin is enabled:
  V1 (``GPUModelRunner`` / ``CPUModelRunner``): ``_update_states`` + ``_prepare_inputs``;
  V2 (``vllm.v1.worker.gpu.model_runner``): ``add_requests`` + ``_remove_request`` +
  ``prepare_inputs``; both: ``sample_tokens`` (the guard report rides on its output).
* API server: ``AsyncLLM.collective_rpc`` / the engine-core utility call, vLLM's exception
  classes (a spec error must be a ``VLLMValidationError`` to become HTTP 400) and its server
  entry point (``dynsteer serve``); the routes themselves use vLLM's public endpoint-plugin
  entry point.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dynsteer.controller.spec import SPEC_KEY, SpecError, SteeringSpec
from dynsteer.controller.wire import WIRE_KEY
from dynsteer.engine_ext.frontend import FrontendState
from dynsteer.engine_ext.import_hooks import when_imported
from dynsteer.engine_ext.options import (
    CONFIG_KEY,
    options_from_additional_config,
    resolve_sites,
)
from dynsteer.engine_ext.prefix_guard import (
    GUARD_KEY,
    REPORT_ATTR,
    STATS,
    CacheGuard,
    fork_keys,
    frontier,
)

WORKER_EXTENSION = "dynsteer.engine_ext.worker_ext.DynsteerWorkerExtension"
_ORIGINAL = "_dynsteer_original_"


def _patch(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` (a class or a module) by ``make(original)`` once (register() may
    run several times)."""
    if _ORIGINAL + name in vars(cls):  # not hasattr: a patched base class must not count
        return
    original = getattr(cls, name)
    setattr(cls, _ORIGINAL + name, original)
    setattr(cls, name, functools.wraps(original)(make(original)))


# ---- frontend ----------------------------------------------------------------------------
def _wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        additional = dict(self.additional_config or {})
        options = options_from_additional_config(additional)
        if options is not None:
            additional[CONFIG_KEY] = options.model_dump()
            self.additional_config = additional
            if self.worker_extension_cls not in ("", WORKER_EXTENSION):
                raise ValueError(
                    f"worker_extension_cls={self.worker_extension_cls!r}: dynsteer needs its own "
                    f"worker extension ({WORKER_EXTENSION}); subclass it to add your methods"
                )
            self.worker_extension_cls = WORKER_EXTENSION
        return original(self, *args, **kwargs)

    return create_engine_config


def frontend_state(input_processor: Any) -> FrontendState | None:
    """The dynsteer frontend state of an engine's input processor (None if not enabled)."""
    state = getattr(input_processor, "_dynsteer_frontend", None)
    if state is None:
        vllm_config = input_processor.vllm_config
        options = options_from_additional_config(vllm_config.additional_config)
        state = False
        if options is not None:
            model_config = vllm_config.model_config
            num_layers = model_config.get_total_num_hidden_layers()
            state = FrontendState(
                options=options,
                hidden_size=model_config.get_hidden_size(),
                num_layers=num_layers,
                sites=resolve_sites(options.sites, num_layers),
                architecture=next(iter(model_config.architectures or []), ""),
                dtype_max=float(torch.finfo(model_config.dtype).max),
            )
        input_processor._dynsteer_frontend = state
    return state or None


def input_processor_of(llm: Any) -> Any:
    """The InputProcessor of an offline ``LLM`` or an ``AsyncLLM`` engine client."""
    engine = getattr(llm, "llm_engine", llm)
    return engine.input_processor


def _parse_request_spec(state: FrontendState | None,
                        params: Any) -> tuple[SteeringSpec, dict[str, Any]] | None:
    """The request's spec checked against the served model and resolved for the workers
    (raises naming the field)."""
    extra = getattr(params, "extra_args", None)
    if not extra or SPEC_KEY not in extra:
        return None
    if state is None:
        raise ValueError(
            f"extra_args.{SPEC_KEY}: this engine was started without dynsteer; start it "
            f"with additional_config={{'{CONFIG_KEY}': {{}}}}"
        )
    try:
        return state.admit_spec(extra[SPEC_KEY])
    except ValueError as e:
        state.counters.requests_rejected += 1
        raise _client_error(e) from e


@functools.cache
def _client_error_class() -> type[ValueError] | None:
    """A ValueError that vLLM's server also reports as HTTP 400 with our message.

    vLLM 0.32 turns any exception of a request's preprocessing into a bare HTTP 500 unless it
    is a ``VLLMValidationError``, which is no longer a ValueError; vLLM 0.26 answers 400 for
    ValueErrors already (None: nothing to do).
    """
    from vllm.exceptions import VLLMValidationError

    if issubclass(VLLMValidationError, ValueError):
        return None

    class DynsteerSpecError(SpecError, VLLMValidationError):
        def __init__(self, message: str) -> None:
            ValueError.__init__(self, message)
            self.parameter = SPEC_KEY
            self.value = None

        def __str__(self) -> str:
            return str(self.args[0])

    return DynsteerSpecError


def _client_error(error: ValueError) -> ValueError:
    cls = _client_error_class()
    return error if cls is None else cls(str(error))


def _wrap_process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_inputs(self: Any, request_id: Any, prompt: Any, params: Any, *args: Any,
                       **kwargs: Any) -> Any:
        state = frontend_state(self)
        admitted = _parse_request_spec(state, params)  # before vLLM builds anything
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if state is not None:
            spec, wire = admitted if admitted is not None else (None, None)
            state.record_request(str(request_id), spec)
            _set_steering(request, state, wire)
        return request

    return process_inputs


def _set_steering(request: Any, state: FrontendState, wire: dict[str, Any] | None) -> None:
    """Replace the client's spec with its resolved form (what the workers read, see
    :mod:`dynsteer.controller.wire`) and attach the prefix-cache guard for the scheduler
    (see :mod:`.prefix_guard`). Keys only the frontend may set are overwritten.

    A fresh ``extra_args`` dict: the request's params may be a shallow copy of the caller's.
    """
    params = getattr(request, "sampling_params", None)
    if params is None:
        return
    tokens = request.prompt_token_ids
    guard = state.cache_guard(wire, len(tokens) if tokens is not None else 0)
    extra = {k: v for k, v in (params.extra_args or {}).items()
             if k not in (GUARD_KEY, SPEC_KEY, WIRE_KEY)}
    if wire is not None:
        extra[WIRE_KEY] = wire
    if guard is not None:
        extra[GUARD_KEY] = guard.model_dump()
    params.extra_args = extra or None


def _patch_input_processor(module: Any) -> None:
    _patch(module.InputProcessor, "process_inputs", _wrap_process_inputs)


def patch_frontend() -> None:
    """Frontend patches (cheap modules, already imported by whoever calls register())."""
    from vllm.engine.arg_utils import EngineArgs

    _patch(EngineArgs, "create_engine_config", _wrap_create_engine_config)
    when_imported("vllm.v1.engine.input_processor", _patch_input_processor)


# ---- scheduler (engine core): the prefix-cache guard --------------------------------------
_GUARD_ATTR = "_dynsteer_guard"
_FRONTIER_ATTR = "_dynsteer_frontier"
_WANTED_ATTR = "_dynsteer_wanted"


def _guard_of(request: Any) -> CacheGuard | None:
    """The request's guard, parsed once and kept on the scheduler's Request (False: none)."""
    guard = getattr(request, _GUARD_ATTR, None)
    if guard is None:
        params = getattr(request, "sampling_params", None)
        raw = (params.extra_args or {}).get(GUARD_KEY) if params is not None else None
        guard = CacheGuard.model_validate(raw) if isinstance(raw, dict) else False
        if guard and guard.withhold:
            STATS.guarded_requests += 1
        setattr(request, _GUARD_ATTR, guard)
    return guard or None


def _wrap_extra_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    def generate_block_hash_extra_keys(request: Any, start: int, end: int, *args: Any,
                                       **kwargs: Any) -> Any:
        keys, next_mm = original(request, start, end, *args, **kwargs)
        guard = _guard_of(request)
        extra = fork_keys(guard, start, end) if guard is not None else None
        if extra is not None:
            keys = (*(keys or ()), extra)
        return keys, next_mm

    return generate_block_hash_extra_keys


def _wrap_cache_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    def cache_blocks(self: Any, request: Any, num_computed_tokens: int, *args: Any,
                     **kwargs: Any) -> Any:
        guard = _guard_of(request)
        if guard is not None and guard.withhold:
            wanted = max(getattr(request, _WANTED_ATTR, 0), num_computed_tokens)
            setattr(request, _WANTED_ATTR, wanted)
            num_computed_tokens = min(num_computed_tokens, getattr(request, _FRONTIER_ATTR, 0))
        return original(self, request, num_computed_tokens, *args, **kwargs)

    return cache_blocks


def _wrap_free(original: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        guard = _guard_of(request)
        if guard is not None and guard.withhold:
            block = self.coordinator.scheduler_block_size
            kept = getattr(request, _FRONTIER_ATTR, 0) // block
            STATS.blocks_withheld += max(0, getattr(request, _WANTED_ATTR, 0) // block - kept)
            setattr(request, _WANTED_ATTR, 0)  # a preempted request counts again when resumed
        return original(self, request, *args, **kwargs)

    return free


def _wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any,
                           *args: Any, **kwargs: Any) -> Any:
        report = getattr(model_runner_output, REPORT_ATTR, None)
        if report:  # before the original: it frees requests that finish in this step
            _apply_cache_report(self, report)
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    return update_from_output


def _apply_cache_report(scheduler: Any, report: dict[str, Any]) -> None:
    """Advance each reported request's clean frontier and cache the blocks now known clean."""
    for req_id, (processed, first_dynamic) in report.items():
        request = scheduler.requests.get(req_id)
        guard = _guard_of(request) if request is not None else None
        if guard is None or not guard.withhold:
            continue
        STATS.reports += 1
        clean = min(frontier(processed, first_dynamic), request.num_computed_tokens)
        if clean > getattr(request, _FRONTIER_ATTR, 0):
            setattr(request, _FRONTIER_ATTR, clean)
            scheduler.kv_cache_manager.cache_blocks(request, clean)


def _add_stats_utility(module: Any) -> None:
    def dynsteer_cache_stats(self: Any) -> dict[str, int]:
        """Prefix-guard counters of this engine core (a utility call for the frontend)."""
        return dict(vars(STATS))

    module.EngineCore.dynsteer_cache_stats = dynsteer_cache_stats


def patch_scheduler() -> None:
    """Engine-core patches of the prefix-cache guard (see :mod:`.prefix_guard`)."""
    when_imported("vllm.v1.core.kv_cache_utils", lambda m: _patch(
        m, "generate_block_hash_extra_keys", _wrap_extra_keys))
    when_imported("vllm.v1.core.kv_cache_coordinator",
                  lambda m: _patch(m.KVCacheCoordinator, "cache_blocks", _wrap_cache_blocks))
    when_imported("vllm.v1.core.kv_cache_manager",
                  lambda m: _patch(m.KVCacheManager, "free", _wrap_free))
    when_imported("vllm.v1.core.sched.scheduler",
                  lambda m: _patch(m.Scheduler, "update_from_output", _wrap_update_from_output))
    when_imported("vllm.v1.engine.core", _add_stats_utility)


def cache_stats(llm: Any) -> dict[str, int]:
    """Prefix-guard counters of an offline ``LLM``'s engine core."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("dynsteer_cache_stats")
    return client.engine_core.dynsteer_cache_stats()  # in-process engine core


async def cache_stats_async(engine_client: Any) -> dict[str, int]:
    """Prefix-guard counters of an ``AsyncLLM``'s engine core."""
    return await engine_client.engine_core.call_utility_async("dynsteer_cache_stats")


# ---- workers -----------------------------------------------------------------------------
def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        options = options_from_additional_config(self.vllm_config.additional_config)
        if options is not None and getattr(self, "dynsteer_state", None) is None:
            from dynsteer.engine_ext.runner import attach

            attach(self, options)
        return result

    return load_model


def patch_workers() -> None:
    """Patch ``load_model`` of each runner class when (if ever) its module is imported."""
    for module in (
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.cpu_model_runner",
        "vllm.v1.worker.gpu.model_runner",
    ):
        cls_name = "CPUModelRunner" if module.endswith("cpu_model_runner") else "GPUModelRunner"
        when_imported(
            module,
            lambda mod, c=cls_name: _patch(getattr(mod, c), "load_model", _wrap_load_model),
        )


def is_v2_runner(runner: Any) -> bool:
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def model_of(runner: Any) -> Any:
    return runner.get_model()


def decoder_layers(model: Any) -> Any:
    """The ``nn.ModuleList`` of decoder layers of a supported model."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(
            f"dynsteer: {type(model).__name__} has no model.layers; its layer contract is unknown"
        )
    return layers


def model_dims(runner: Any) -> tuple[int, int]:
    """(hidden size, total decoder layers) of the served model."""
    mc = runner.vllm_config.model_config
    return mc.get_hidden_size(), mc.get_total_num_hidden_layers()


def token_capacity(runner: Any) -> int:
    """Largest token count a forward can see (batched tokens or a padded CUDA-graph size)."""
    capture = runner.vllm_config.compilation_config.max_cudagraph_capture_size or 0
    return max(runner.max_num_tokens, capture)


def kv_block_size(runner: Any) -> int:
    """Tokens per KV-cache block (the prefix cache shares whole blocks)."""
    return int(runner.vllm_config.cache_config.block_size)


def request_capacity(runner: Any) -> int:
    return runner.vllm_config.scheduler_config.max_num_seqs


def install_step_hooks(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str], None],
                       on_step: Callable[..., None],
                       on_output: Callable[[], dict[str, Any]]) -> None:
    """Hook the runner instance so the state sees admissions, removals and each step.

    ``on_add(req_id, slot_or_None, extra_args, prompt_len)`` (V1 passes None: the adapter picks
    a slot), ``on_remove(req_id)``, ``on_step(req_ids, slots_or_None, num_computed,
    num_scheduled)``; ``on_output()`` returns the prefix-guard report that rides on the step's
    ``ModelRunnerOutput`` to the scheduler (see :mod:`.prefix_guard`).
    """
    if is_v2_runner(runner):
        _install_v2(runner, on_add, on_remove, on_step)
    else:
        _install_v1(runner, on_add, on_remove, on_step)
    sample_tokens = runner.sample_tokens

    def _sample_tokens(*args: Any, **kwargs: Any) -> Any:
        return _attach_report(sample_tokens(*args, **kwargs), on_output())

    runner.sample_tokens = _sample_tokens


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


def _install_v1(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str], None],
                on_step: Callable[..., None]) -> None:
    update_states = runner._update_states
    prepare_inputs = runner._prepare_inputs

    def _update_states(scheduler_output: Any) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            on_remove(req_id)
        result = update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            req = runner.requests[new.req_id]
            on_add(new.req_id, None, params.extra_args if params else None, req.num_prompt_tokens)
        return result

    def _prepare_inputs(scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = runner.input_batch
        n = batch.num_reqs
        on_step(batch.req_ids[:n], None, batch.num_computed_tokens_cpu[:n], num_scheduled_tokens)
        return result

    runner._update_states = _update_states
    runner._prepare_inputs = _prepare_inputs


def _install_v2(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str], None],
                on_step: Callable[..., None]) -> None:
    add_requests = runner.add_requests
    remove_request = runner._remove_request
    prepare_inputs = runner.prepare_inputs

    def _add_requests(scheduler_output: Any) -> Any:
        result = add_requests(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            slot = runner.req_states.req_id_to_index[new.req_id]
            extra = params.extra_args if params else None
            on_add(new.req_id, slot, extra, len(new.prompt_token_ids))
        return result

    def _remove_request(req_id: str) -> Any:
        on_remove(req_id)
        return remove_request(req_id)

    def _prepare_inputs(scheduler_output: Any, batch_desc: Any) -> Any:
        batch = prepare_inputs(scheduler_output, batch_desc)
        on_step(batch.req_ids, batch.idx_mapping_np, batch.num_computed_tokens_np,
                batch.num_scheduled_tokens)
        return batch

    runner.add_requests = _add_requests
    runner._remove_request = _remove_request
    runner.prepare_inputs = _prepare_inputs


# ---- frontend requests -------------------------------------------------------------------
def one_token_params(extra_args: dict[str, Any]) -> Any:
    """``SamplingParams`` of an internal request that only needs its prompt processed (one
    greedy token, no detokenizing, only the final output) and carries ``extra_args``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra_args)


# ---- API server -------------------------------------------------------------------------
async def collective_rpc_async(engine_client: Any, method: str, args: tuple[Any, ...],
                               timeout: float | None = None) -> list[Any]:
    """``AsyncLLM.collective_rpc`` (a coroutine on the API server's engine client)."""
    return await engine_client.collective_rpc(method, timeout=timeout, args=args)


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def run_api_server(argv: list[str]) -> None:
    """Run vLLM's OpenAI-compatible server (``python -m`` style) with ``argv``; blocks."""
    import runpy
    import sys

    sys.argv = ["dynsteer serve", *argv]
    try:
        from vllm.entrypoints.launchers.api_server.entry import main  # vLLM >= 0.32
    except ImportError:  # vLLM 0.26: the module's __main__ block is the entry point
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__",
                         alter_sys=True)
        return
    main()
