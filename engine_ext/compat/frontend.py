"""vLLM's frontend: engine arguments, the input processor and the engine-client calls.

* ``EngineArgs.create_engine_config``: the dynsteer options are normalized (plugin version and
  kernel ABI become part of vLLM's compile-cache key, so a graph compiled without the plugin or
  with other sites is never reused) and the worker extension is set.
* ``InputProcessor.process_inputs``: a request's spec is admitted before vLLM builds anything
  (rejected with an error naming the field: HTTP 400 on the server) and replaced by what the
  scheduler and workers read. It runs in the context of the request's caller (context
  variables, :mod:`dynsteer.engine_ext.frontend.caller`), also when vLLM hands raw prompts to
  its tokenizer threads (``process_inputs_async``), which would otherwise run it in a context
  of their own.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .patching import patch, when_imported

WORKER_EXTENSION = "dynsteer.engine_ext.worker.rpc.DynsteerWorkerExtension"


@dataclass(frozen=True)
class EngineFacts:
    """What the frontend knows about one served model, in vLLM-free terms."""

    additional_config: dict[str, Any]
    hidden_size: int
    num_layers: int
    architecture: str
    """The served model class (``config.architectures[0]``)."""
    dtype_max: float
    """Largest finite value of the model's dtype."""
    missing_hook: Callable[[str], str | None] | None = None
    """Why the model's layers have no such hook (``post_attn`` of a parallel attention + MLP
    layer), naming the layer class, or None where they have it (None: not known)."""


@dataclass(frozen=True)
class Generation:
    """What a request asks vLLM to generate, as its ``SamplingParams`` say."""

    max_tokens: int | None
    n: int = 1


@dataclass(frozen=True)
class FrontendHooks:
    """How the adapter calls dynsteer's frontend."""

    configure: Callable[[dict[str, Any]], dict[str, Any] | None]
    """An engine's ``additional_config`` normalized, or None when dynsteer is not enabled."""
    engine_state: Callable[[EngineFacts], Any]
    """The state of one engine's frontend (None: not enabled); built once per engine."""
    admit: Callable[[Any, dict[str, Any] | None], Any]
    """``(state, extra_args)`` before vLLM builds the request: raise ValueError naming the
    field to reject it; returns what :attr:`admitted` gets."""
    admitted: Callable[[Any, str, Any, int, Generation, dict[str, Any] | None],
                       dict[str, Any] | None]
    """``(state, request id, admit's result, prompt length, generation, extra_args)`` once the
    request exists (enabled engines only): the request's new ``extra_args``; may still reject
    it with a ValueError naming the field."""
    spec_key: str
    """The ``extra_args`` key of the client's spec: once :attr:`admit` parsed it, vLLM gets
    params without it (it deep-copies them per request, and a spec's float lists would cost
    it more than the whole admission)."""


_hooks: FrontendHooks | None = None
"""The installed hooks (what :func:`engine_state` builds a missing state with)."""


def install(hooks: FrontendHooks) -> None:
    global _hooks
    from vllm.engine.arg_utils import EngineArgs

    _hooks = hooks
    patch(EngineArgs, "create_engine_config", functools.partial(_create_engine_config, hooks))
    when_imported("vllm.v1.engine.input_processor", _patch_input_processor)


def _patch_input_processor(module: Any) -> None:
    assert _hooks is not None
    patch(module.InputProcessor, "process_inputs", functools.partial(_process_inputs, _hooks))
    patch(module.InputProcessor, "__init__", _keep_caller_context)


_CONTEXT_KW = "_dynsteer_context"
"""Keyword that carries the caller's context into ``process_inputs`` on a tokenizer thread."""


def _keep_caller_context(original: Callable[..., None]) -> Callable[..., None]:
    """``InputProcessor.__init__``, then ``process_inputs_async`` (vLLM's ``make_async`` of the
    patched ``process_inputs``, run on an executor thread) made to pass the event loop's
    context along: ``run_in_executor`` does not copy context variables."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        run_async = getattr(self, "process_inputs_async", None)
        if run_async is not None:
            self.process_inputs_async = functools.partial(_in_caller_context, run_async)

    return __init__


def _in_caller_context(run_async: Callable[..., Awaitable[Any]], *args: Any,
                       **kwargs: Any) -> Awaitable[Any]:
    return run_async(*args, **kwargs, **{_CONTEXT_KW: contextvars.copy_context()})


def _create_engine_config(hooks: FrontendHooks,
                          original: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        additional = hooks.configure(dict(self.additional_config or {}))
        if additional is not None:
            self.additional_config = additional
            if self.worker_extension_cls not in ("", WORKER_EXTENSION):
                raise ValueError(
                    f"worker_extension_cls={self.worker_extension_cls!r}: dynsteer needs its own "
                    f"worker extension ({WORKER_EXTENSION}); subclass it to add your methods"
                )
            self.worker_extension_cls = WORKER_EXTENSION
        return original(self, *args, **kwargs)

    return create_engine_config


def _process_inputs(hooks: FrontendHooks, original: Callable[..., Any]) -> Callable[..., Any]:
    def process_inputs(self: Any, request_id: Any, prompt: Any, params: Any, *args: Any,
                       **kwargs: Any) -> Any:
        context = kwargs.pop(_CONTEXT_KW, None)
        if context is not None:
            return context.run(process_inputs, self, request_id, prompt, params, *args,
                               **kwargs)
        state = _engine_state(hooks, self)
        try:
            admitted = hooks.admit(state, getattr(params, "extra_args", None))
        except ValueError as e:
            raise _client_error(e) from e
        if admitted is not None:
            params = _without(params, hooks.spec_key)
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if state is not None:
            request_params = getattr(request, "sampling_params", None)
            tokens = getattr(request, "prompt_token_ids", None)
            try:
                extra = hooks.admitted(state, str(request_id), admitted,
                                       len(tokens) if tokens is not None else 0,
                                       Generation(getattr(request_params, "max_tokens", None),
                                                  getattr(request_params, "n", 1) or 1),
                                       request_params.extra_args if request_params else None)
            except ValueError as e:
                raise _client_error(e) from e
            if request_params is not None:
                # A fresh dict: the params may be a shallow copy of the caller's.
                request_params.extra_args = extra
        return request

    return process_inputs


def _without(params: Any, key: str) -> Any:
    """A shallow copy of ``params`` whose ``extra_args`` leave out ``key`` (the caller's
    params stay as they are: they may be shared by many prompts and threads)."""
    extra = getattr(params, "extra_args", None)
    if not extra or key not in extra:
        return params
    copied = copy.copy(params)
    copied.extra_args = {k: v for k, v in extra.items() if k != key}
    return copied


_STATE_ATTR = "_dynsteer_frontend"


def _engine_state(hooks: FrontendHooks, input_processor: Any) -> Any:
    """The engine's dynsteer frontend state, built on first use (None: not enabled)."""
    state = getattr(input_processor, _STATE_ATTR, None)
    if state is None:
        config = input_processor.vllm_config
        model = config.model_config
        architecture = next(iter(model.architectures or []), "")
        import torch

        state = hooks.engine_state(EngineFacts(
            additional_config=dict(config.additional_config or {}),
            hidden_size=model.get_hidden_size(),
            num_layers=model.get_total_num_hidden_layers(),
            architecture=architecture,
            dtype_max=float(torch.finfo(model.dtype).max),
            missing_hook=functools.partial(_missing_hook, architecture),
        ))
        setattr(input_processor, _STATE_ATTR, False if state is None else state)
    return state or None


def _missing_hook(architecture: str, hook: str) -> str | None:
    from .census import missing_hook

    return missing_hook(architecture, hook)


def engine_state(engine: Any) -> Any:
    """The dynsteer frontend state of an offline ``LLM`` or an ``AsyncLLM`` engine client
    (None: dynsteer is not enabled on it, or no request or engine config went through the
    patched frontend)."""
    processor = getattr(engine, "llm_engine", engine).input_processor
    state = getattr(processor, _STATE_ATTR, None)
    if state is None and _hooks is not None:
        state = _engine_state(_hooks, processor)
    return state or None


@functools.cache
def _client_error_class(kind: type[ValueError]) -> type[ValueError] | None:
    """A subclass of ``kind`` that vLLM's server also reports as HTTP 400 with our message.

    vLLM 0.32 turns any exception of a request's preprocessing into a bare HTTP 500 unless it
    is a ``VLLMValidationError``, which is not a ValueError there; vLLM 0.26 answers 400 for
    ValueErrors (None: nothing to do).
    """
    from vllm.exceptions import VLLMValidationError

    if issubclass(VLLMValidationError, ValueError):
        return None

    class ClientError(kind, VLLMValidationError):  # type: ignore[valid-type, misc]
        def __init__(self, message: str) -> None:
            ValueError.__init__(self, message)
            self.parameter = "dynsteer"
            self.value = None

        def __str__(self) -> str:
            return str(self.args[0])

    ClientError.__name__ = ClientError.__qualname__ = f"Dynsteer{kind.__name__}"
    return ClientError


def _client_error(error: ValueError) -> ValueError:
    cls = _client_error_class(type(error))
    return error if cls is None else cls(str(error))


def prompt_request_ids(request_id: str) -> list[str]:
    """Ids vLLM's completion route gives the prompts of one call with ``request_id``."""
    return [f"{request_id}-{i}" for i in range(8)]


def child_request_id(request_id: str, index: int) -> str:
    """The request id of completion ``index`` of a request sampled ``n > 1`` times: vLLM runs
    each completion as a request of its own, named so."""
    return f"{index}_{request_id}"


def completion_requests(output: Any) -> list[tuple[str, int | None]]:
    """(request id, positions computed) of each completion of a finished ``RequestOutput``,
    in the order of their ``index``: the request's own id for one completion, each one's
    (:func:`child_request_id`) for more."""
    if len(output.outputs) == 1:
        return [(output.request_id, computed_positions(output))]
    prompt = len(output.prompt_token_ids) if output.prompt_token_ids is not None else None
    return [(child_request_id(output.request_id, c.index),
             None if prompt is None else prompt + len(c.token_ids) - 1)
            for c in sorted(output.outputs, key=lambda c: c.index)]


def computed_positions(output: Any) -> int | None:
    """How many positions a finished ``RequestOutput`` had computed: its prompt and every
    generated token but the last (None: not one completion)."""
    if len(output.outputs) != 1 or output.prompt_token_ids is None:
        return None
    return len(output.prompt_token_ids) + len(output.outputs[0].token_ids) - 1


def rpc(llm: Any, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """``LLM.collective_rpc``: one reply per worker."""
    return llm.collective_rpc(method, args=args)


async def rpc_async(engine_client: Any, method: str, args: tuple[Any, ...] = (),
                    timeout: float | None = None) -> list[Any]:
    """``AsyncLLM.collective_rpc`` (the API server's engine client)."""
    return await engine_client.collective_rpc(method, timeout=timeout, args=args)


def engine_core_call(llm: Any, name: str) -> Any:
    """An engine-core utility method of an offline ``LLM`` (see :mod:`.scheduler`)."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility(name)
    return getattr(client.engine_core, name)()  # in-process engine core


async def engine_core_call_async(engine_client: Any, name: str) -> Any:
    """An engine-core utility method of an ``AsyncLLM``."""
    return await engine_client.engine_core.call_utility_async(name)


def one_token_params(extra_args: dict[str, Any]) -> Any:
    """``SamplingParams`` of an internal request that only needs its prompt processed (one
    greedy token, no detokenizing, only the final output) and carries ``extra_args``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra_args)
