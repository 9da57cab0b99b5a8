"""Every access to vLLM internals, for vLLM 0.26 (GPU, V2 runner) through 0.32 (CPU, V1 runner).

The next vLLM release should be a change to this file only. What is touched, and why:

* ``EngineArgs.create_engine_config`` (frontend): normalizes ``additional_config["dynsteer"]``
  (plugin version, kernel ABI: part of vLLM's compile-cache key, so a graph compiled without the
  plugin, or with other sites, is never reused) and sets ``worker_extension_cls``.
* ``InputProcessor.process_inputs`` (frontend): rejects a bad spec at ``generate()`` / request
  time with an error naming the field (the engine never sees it), and forks the prefix-cache
  key of steered requests through ``EngineCoreRequest.cache_salt`` (see :func:`steering_salt`).
* Model runners' ``load_model`` (workers): wraps the decoder layers once the model exists, before
  the first forward (profile run = first trace).
* Per-step hooks, installed on the runner *instance* only when the plugin is enabled:
  V1 (``GPUModelRunner`` / ``CPUModelRunner``): ``_update_states`` + ``_prepare_inputs``;
  V2 (``vllm.v1.worker.gpu.model_runner``): ``add_requests`` + ``_remove_request`` +
  ``prepare_inputs``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from dynsteer.controller.spec import (
    SPEC_KEY,
    ModelShape,
    SteeringSpec,
    check_against_model,
    parse_spec,
)
from dynsteer.engine_ext.import_hooks import when_imported
from dynsteer.engine_ext.options import (
    CONFIG_KEY,
    EngineOptions,
    options_from_additional_config,
    resolve_sites,
)

WORKER_EXTENSION = "dynsteer.engine_ext.worker_ext.DynsteerWorkerExtension"
_ORIGINAL = "_dynsteer_original_"


def _patch(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)`` once (register() may run several times)."""
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


class FrontendState:
    """What the frontend knows to validate specs: the model shape and registered names."""

    def __init__(self, vllm_config: Any, options: EngineOptions) -> None:
        model_config = vllm_config.model_config
        self.options = options
        self.hidden_size = model_config.get_hidden_size()
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.sites = resolve_sites(options.sites, self.num_layers)
        self.vector_names: set[str] = set()
        self.probe_names: set[str] = set()
        self.registry_generation = 0
        """Bumped on every vector/probe (un)registration: named contents may have changed."""
        self.global_fingerprint: str | None = None
        """Fingerprint of the current global steering (None when there is none)."""
        self.global_phase_specific = False
        """Whether global steering has prefill- or decode-only entries."""

    def shape(self) -> ModelShape:
        return ModelShape(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            sites=frozenset(self.sites),
            vector_names=frozenset(self.vector_names),
            probe_names=frozenset(self.probe_names),
        )


def frontend_state(input_processor: Any) -> FrontendState | None:
    """The dynsteer frontend state of an engine's input processor (None if not enabled)."""
    state = getattr(input_processor, "_dynsteer_frontend", None)
    if state is None:
        vllm_config = input_processor.vllm_config
        options = options_from_additional_config(vllm_config.additional_config)
        state = FrontendState(vllm_config, options) if options is not None else False
        input_processor._dynsteer_frontend = state
    return state or None


def input_processor_of(llm: Any) -> Any:
    """The InputProcessor of an offline ``LLM`` or an ``AsyncLLM`` engine client."""
    engine = getattr(llm, "llm_engine", llm)
    return engine.input_processor


def _phase_specific(spec: SteeringSpec | None, state: FrontendState) -> bool:
    """Whether any entry steers prompt and generated positions differently."""
    if state.global_phase_specific:
        return True
    if spec is None:
        return False
    entries = [*spec.steer, *(spec.gate.steer if spec.gate else [])]
    return any(e.phase != "all" for e in entries)


def steering_salt(state: FrontendState, spec: SteeringSpec | None,
                  prompt_len: int | None) -> str | None:
    """Prefix-cache salt of a request: None for unsteered requests, else a fingerprint.

    KV computed under steering is a deterministic function of the tokens, the request's spec,
    the global steering and the named vectors/probes it uses. Salting with exactly those keeps
    steered KV from ever being served to a request steered differently (or not at all), while
    unsteered requests keep sharing blocks with each other and identically steered ones share
    among themselves. vLLM chains block hashes, so a salt on the first block forks all of them.
    With phase-specific entries the KV of a position also depends on whether it is a prompt or a
    generated position, so the prompt length joins the fingerprint (None: unknown, no sharing).
    """
    if spec is None and state.global_fingerprint is None:
        return None
    h = hashlib.blake2b(digest_size=12)
    if spec is not None:
        h.update(spec.model_dump_json().encode())
    h.update(f"|global={state.global_fingerprint}|registry={state.registry_generation}".encode())
    if _phase_specific(spec, state):
        h.update(f"|prompt_len={prompt_len if prompt_len is not None else os.urandom(8)}".encode())
    return f"dynsteer:{h.hexdigest()}"


def _parse_request_spec(state: FrontendState | None, params: Any) -> SteeringSpec | None:
    """The request's spec checked against the served model (raises naming the field)."""
    extra = getattr(params, "extra_args", None)
    if not extra or SPEC_KEY not in extra:
        return None
    if state is None:
        raise ValueError(
            f"extra_args.{SPEC_KEY}: this engine was started without dynsteer; start it "
            f"with additional_config={{'{CONFIG_KEY}': {{}}}}"
        )
    spec = parse_spec(extra[SPEC_KEY])
    check_against_model(spec, state.shape())
    return spec


def _wrap_process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_inputs(self: Any, request_id: Any, prompt: Any, params: Any, *args: Any,
                       **kwargs: Any) -> Any:
        state = frontend_state(self)
        spec = _parse_request_spec(state, params)  # before vLLM builds anything
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if state is not None:
            tokens = request.prompt_token_ids
            salt = steering_salt(state, spec, len(tokens) if tokens is not None else None)
            if salt is not None:
                user = request.cache_salt
                request.cache_salt = salt if not user else f"{user}|{salt}"
        return request

    return process_inputs


def _patch_input_processor(module: Any) -> None:
    _patch(module.InputProcessor, "process_inputs", _wrap_process_inputs)


def patch_frontend() -> None:
    """Frontend patches (cheap modules, already imported by whoever calls register())."""
    from vllm.engine.arg_utils import EngineArgs

    _patch(EngineArgs, "create_engine_config", _wrap_create_engine_config)
    when_imported("vllm.v1.engine.input_processor", _patch_input_processor)


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


def request_capacity(runner: Any) -> int:
    return runner.vllm_config.scheduler_config.max_num_seqs


def install_step_hooks(runner: Any, on_add: Callable[..., None], on_remove: Callable[[str], None],
                       on_step: Callable[..., None]) -> None:
    """Hook the runner instance so the state sees admissions, removals and each step.

    ``on_add(req_id, slot_or_None, extra_args, prompt_len)`` (V1 passes None: the adapter picks
    a slot), ``on_remove(req_id)``, ``on_step(req_ids, slots_or_None, num_computed,
    num_scheduled)``.
    """
    if is_v2_runner(runner):
        _install_v2(runner, on_add, on_remove, on_step)
    else:
        _install_v1(runner, on_add, on_remove, on_step)


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
