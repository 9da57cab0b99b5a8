"""Starting and stopping real CPU vLLM engines in tests, and reading their logprobs."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

ALL_SITES = "pre_attn@*,post_attn@*,post_block@*"
"""Every hook at every layer (the ``sites`` engine option)."""

LOGPROB_ATOL = 2e-3
"""Two fp32 computations of the same logprobs (the engine vs HF, TP=2 vs TP=1) agree to this."""

ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
    skip_tokenizer_init=True, seed=0,
)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def refuse_in_fast_lane() -> None:
    """The fast lane (``make test-fast``: ``-m "not engine"``) starts no engine: a test that
    does must be marked ``engine``, or the lane's time grows unnoticed."""
    if os.environ.get("DYNSTEER_FAST_LANE"):
        import pytest

        pytest.fail("this test starts an engine: mark it @pytest.mark.engine")


def start_llm(path: Any, dynsteer: dict[str, Any] | None = None, in_process: bool = False,
              **kwargs: Any) -> Any:
    """A real vLLM engine (compile on, the CPU default), with the plugin when ``dynsteer``;
    with ``in_process``, its engine core and worker run in this process
    (:class:`InProcessEngine`). A start that fails in this process raises the worker's own
    error."""
    from vllm import LLM

    refuse_in_fast_lane()
    args = {**ENGINE_DEFAULTS, **kwargs}
    if dynsteer is not None:
        args["additional_config"] = {"dynsteer": dynsteer}
    if not in_process:
        return LLM(str(path), **args)
    state = InProcessEngine()
    try:
        with environ(IN_PROCESS):
            llm = LLM(str(path), **args)
    except BaseException:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        state.started()
        cleanup_dist_env_and_memory()  # what the engine core's shutdown would have done
        state.restore()
        raise
    state.started()
    llm.dynsteer_test_in_process = state
    return llm


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""The environment in which ``LLM`` runs its engine core (and its single worker) in the calling
process instead of spawning two processes that import torch and vLLM again, which is most of
the start of an engine of a tiny model. vLLM reads it when the engine is built; it is set only
for that, so engines started later in the same process spawn theirs as before."""


def _transformers_classes() -> list[type]:
    """The HF transformers ``nn.Module`` classes loaded in this process."""
    import torch

    found, todo = [], [torch.nn.Module]
    seen: set[type] = set()
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                if sub.__module__.startswith("transformers."):
                    found.append(sub)
    return found


class InProcessEngine:
    """What an engine started in this process (``start_llm(in_process=True)``) changes in it
    beyond its own objects, undone when it stops (:func:`stop_llm`), so that the next engine
    and the HF reference models in this process run as beside an engine in its own process.

    - vLLM's Transformers backend (OLMo 3, GPT-NeoX, Phi-2) makes the HF decoder class itself
      (``PhiModel``) compilable: ``support_torch_compile`` adds a base class and replaces
      ``__init__`` and ``__call__`` on the class, for the life of the process. An HF model of
      that class built before (the reference the tests compare against) then calls vLLM's
      ``__call__`` without the attributes its ``__init__`` sets (``AttributeError:
      do_not_compile``), and one built after would run through vLLM's compilation. Each HF
      class is restored to what it was before the engine started; a class loaded during the
      start, which cannot be restored, stops the test.
    - Each compiled model registers a Dynamo bytecode hook (a bound method of the model) that
      vLLM never removes: it would keep every model of the process alive. Dynamo's caches,
      which hold the finished engine's compiled code, are reset.
    - The CPU worker replaces ``torch.set_num_threads`` by a function that ignores it, sets
      environment variables for its (here absent) child processes, and seeds the random
      generators of ``random``, NumPy and torch.

    The engine core's own shutdown undoes the rest: it unfreezes the garbage collector (frozen
    at startup), destroys the distributed groups and lets vLLM read the environment again
    (it caches it while an engine runs)."""

    def __init__(self) -> None:
        import torch
        from torch._dynamo import convert_frame

        self.environ = dict(os.environ)
        self.changed: dict[str, str | None] = {}
        self.set_num_threads = torch.set_num_threads
        self.random = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.hooks = set(convert_frame._bytecode_hooks)
        self.classes = {cls: (cls.__bases__, dict(vars(cls))) for cls in _transformers_classes()}

    def started(self) -> None:
        """Records the environment variables the start changed (kept while the engine runs)."""
        now = dict(os.environ)
        self.changed = {name: self.environ.get(name) for name in now.keys() | self.environ.keys()
                        if now.get(name) != self.environ.get(name)}

    def restore(self) -> None:
        import torch
        from torch._dynamo import convert_frame
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper as Wrapper

        for name, value in self.changed.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads = self.set_num_threads
        random.setstate(self.random[0])
        np.random.set_state(self.random[1])
        torch.set_rng_state(self.random[2])
        for key in set(convert_frame._bytecode_hooks) - self.hooks:
            del convert_frame._bytecode_hooks[key]
        for cls, (bases, attrs) in self.classes.items():
            if Wrapper in cls.__bases__ and Wrapper not in bases:
                cls.__bases__ = bases
                for name in vars(cls).keys() - attrs.keys():
                    delattr(cls, name)
                for name, value in attrs.items():
                    if vars(cls).get(name) is not value:
                        setattr(cls, name, value)
        left = [cls.__qualname__ for cls in _transformers_classes() if Wrapper in cls.__bases__]
        assert not left, (f"vLLM made HF classes {left} compilable, loaded while an in-process "
                          "engine started: load the HF model first, so they can be restored")
        torch._dynamo.reset()


WITHOUT_INDUCTOR = {"VLLM_CPU_CI_ENV": "1"}
"""The environment of an engine that runs its compiled graph without Inductor: vLLM's own CPU CI
mode, in which Dynamo still traces the model with the plugin's ops in it and splits it at
attention, but the graph's ops run as they are instead of as generated C++, and the warm-up
pass is skipped. An engine starts in half the time (a third for the embedded model). Tests
whose subject is not the compiled code use it: most of the architecture sweep, the experiments
except the safety demo, capture, tensor parallelism, and servers other than ``test_server``'s.
The rest (the Llama / Qwen references, steering, gating, prefix caching, controllers, LoRA,
engine behaviour) run Inductor as deployed, and so does pipeline parallelism, whose later
stages allocate their inputs in the warm-up this mode skips."""


@contextmanager
def without_inductor() -> Iterator[None]:
    """Engines (and servers) started inside run without Inductor (:data:`WITHOUT_INDUCTOR`):
    the frontend reads the variable when it builds the config, the engine process inherits it
    at spawn. The caller's environment is restored on exit."""
    with environ(WITHOUT_INDUCTOR):
        yield


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """The environment variables ``values`` set inside; the caller's restored on exit."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_llm(llm: Any) -> None:
    """Stops the engine; one started in this process also undoes what it changed in it
    (:class:`InProcessEngine`)."""
    state = getattr(llm, "dynsteer_test_in_process", None)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if state is not None:
        state.restore()


async def start_async_llm(path: Any, dynsteer: dict[str, Any] | None = None,
                          **kwargs: Any) -> Any:
    """An ``AsyncLLM`` (the API server's engine client), created inside the running loop so its
    output handler lives there; every later call must run on that same loop."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    refuse_in_fast_lane()
    args = {**ENGINE_DEFAULTS, **kwargs}
    if dynsteer is not None:
        args["additional_config"] = {"dynsteer": dynsteer}
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(path), **args))


def stop_async_llm(engine: Any) -> None:
    engine.shutdown()
    del engine
    gc.collect()


def params(max_tokens: int = 6, spec: Any = None, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    extra = {"dynsteer": spec} if spec is not None else None
    kwargs.setdefault("prompt_logprobs", 0)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False,
                          ignore_eos=True, extra_args=extra, **kwargs)


def run(llm: Any, prompts: list[list[int]], sps: list[Any]) -> list[Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return list(outs)


def generated_logprobs(out: Any) -> tuple[list[int], np.ndarray]:
    """(generated tokens, their logprobs) of one finished request."""
    gen = list(out.outputs[0].token_ids)
    lps = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen, strict=True)]
    return gen, np.asarray(lps, dtype=np.float64)


def logprobs_of(out: Any) -> tuple[list[int], np.ndarray]:
    """(all tokens, logprob of tokens[1:]) of one finished request: prompt then generated."""
    prompt = list(out.prompt_token_ids)
    gen, gen_lps = generated_logprobs(out)
    lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    return prompt + gen, np.concatenate([np.asarray(lps, dtype=np.float64), gen_lps])


def assert_same_output(out: Any, ref: Any, atol: float = 1e-5) -> None:
    """Two finished requests generated the same tokens with the same logprobs (to ``atol``; the
    default for the same computation run twice): of the prompt and generated tokens, or of the
    generated ones where ``out`` asked for no prompt logprobs."""
    assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
    read = generated_logprobs if out.prompt_logprobs is None else logprobs_of
    np.testing.assert_allclose(read(out)[1], read(ref)[1], atol=atol)


def raw_set_global(llm: Any, wire: list[Any]) -> None:
    """Global steering written unchecked: the workers' RPC with resolved entries, then the
    frontend's record of it (so requests are admitted under it), bypassing the control plane's
    checks (for defence-in-depth tests of the workers)."""
    from dynsteer.controller.wire import fingerprint
    from dynsteer.engine_ext import Steering

    key = fingerprint(wire).hex() if wire else None
    llm.collective_rpc("dynsteer_set_global", args=(wire, key or "-"))
    Steering(llm)._plane.frontend.set_global([], wire, key)
