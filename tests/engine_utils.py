"""Starting and stopping real CPU vLLM engines in tests, and reading their logprobs."""

from __future__ import annotations

import gc
import os
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


def start_llm(path: Any, dynsteer: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A real vLLM engine (compile on, the CPU default), with the plugin when ``dynsteer``."""
    from vllm import LLM

    refuse_in_fast_lane()
    args = {**ENGINE_DEFAULTS, **kwargs}
    if dynsteer is not None:
        args["additional_config"] = {"dynsteer": dynsteer}
    return LLM(str(path), **args)


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
    old = {name: os.environ.get(name) for name in WITHOUT_INDUCTOR}
    os.environ.update(WITHOUT_INDUCTOR)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def stop_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


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
