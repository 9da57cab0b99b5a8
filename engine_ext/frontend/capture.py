"""Activation capture through the served engine, for training probes (frontend; no network code).

For a list of prompts, researchers get the residual stream at some sites (``hook@layer``, the
engine's configured sites), reduced per prompt: ``last`` (last prompt token), ``mean`` (over
the prompt tokens) or ``all`` (every prompt token), as float32 numpy arrays. The engine's own
compiled forward computes them (torch.compile and CUDA graphs stay on): the in-graph op stores
the stream of marked prompt tokens into a capture buffer (:mod:`.ops`, :mod:`.capture_buffers`),
so normal traffic keeps running alongside and pays one int load per token.

One capture (one at a time per engine; a lock serializes them, normal traffic is not blocked):

1. :func:`plan_capture` validates the arguments and splits the work into *passes* of at most
   ``dynsteer.capture_lanes`` sites and *rounds* of prompts whose lengths sum to at most
   ``dynsteer.capture_tokens`` (the capture rows).
2. Per pass: ``dynsteer_capture_begin`` gives the sites lanes; per round, the prompts run as
   requests with ``max_tokens=1`` (prefill only), a unique ``cache_salt`` (a prefix-cache hit
   would skip computing, hence capturing, the cached positions) and
   ``extra_args["dynsteer_capture"] = "<ticket>:<item>"``; then ``dynsteer_capture_collect``
   returns the rows reduced on the device (TP rank 0 only) and frees them;
   ``dynsteer_capture_end`` closes the pass, whatever happened.
3. :class:`_Assembler` checks and decodes the replies into ``{site: array}``.

The sequence of engine calls is written once, as a generator (:func:`_protocol`) that yields
each call to make; :func:`capture_sync` (offline ``vllm.LLM``, used by ``Steering.capture``)
and :func:`capture_async` (``AsyncLLM``, the API server's engine client) only execute them.
Prompts are matched to their rows by the ``extra_args`` key, not by request id, so vLLM's
internal request-id suffix does not matter.

What is captured is the stream as the engine serves it: global steering, when set, applies to
capture prompts too (they carry no spec of their own).
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynsteer.controller.contract import (
    F32,
    encode_f32,
    resolve_sites,
    site_name,
    unmonitored_site,
)
from dynsteer.controller.extra_args import CAPTURE_KEY

from ..compat import frontend as vllm_frontend
from ..worker.capture_buffers import REDUCES, Reduce, capture_key
from .caller import TRUSTED, acting_as

CaptureResult = dict[str, np.ndarray | list[np.ndarray]]
"""Per site (``hook@layer``): ``[N, H]`` for ``last``/``mean``, a list of N ``[len_i, H]``
arrays for ``all`` (float32, prompts in the order given)."""


class CaptureArgs(BaseModel):
    """What a capture is asked for (the Python API's arguments; also an HTTP body)."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[list[Annotated[int, Field(ge=0)]] | str] = Field(min_length=1)
    """Token-id lists, or texts tokenized with the engine's tokenizer (special tokens added,
    as vLLM does for a completion prompt)."""
    sites: str | list[str]
    """Sites in the site grammar, e.g. ``"post_block@*"`` or ``["post_attn@3", "post_block@3"]``;
    each must be a monitor site of the engine (``dynsteer.monitor_sites``)."""
    reduce: Reduce = "last"
    """Per prompt: the ``last`` prompt token, the ``mean`` over its tokens, or ``all`` of them."""


class _CapturedItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1)
    data: bytes
    """Little-endian float32 (RPC replies carry bytes as they are: no base64 on the way)."""


class _CaptureReply(BaseModel):
    """What one worker's ``dynsteer_capture_collect`` returns (see :mod:`.capture_buffers`)."""

    model_config = ConfigDict(extra="forbid")

    sites: list[str]
    hidden: int = Field(ge=1)
    reduce: Reduce
    items: dict[str, _CapturedItem]
    missing: dict[str, str]


def parse_args(prompts: Any, sites: Any, reduce: Any) -> CaptureArgs:
    """Validated arguments, or a ``ValueError`` whose message starts with the field path."""
    if isinstance(prompts, np.ndarray):
        prompts = list(prompts)
    if isinstance(prompts, (list, tuple)):
        prompts = [p.tolist() if isinstance(p, np.ndarray) else p for p in prompts]
    try:
        return CaptureArgs(prompts=prompts, sites=sites, reduce=reduce)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = [p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p == "str"))]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        raise ValueError(f"{path}: {first['msg']}") from None


@dataclass(frozen=True)
class CaptureItem:
    """One request of a round: prompt ``index`` under capture ``key``."""

    index: int
    key: str
    request_id: str
    prompt: dict[str, Any]
    """A ``TokensPrompt`` dict with a unique ``cache_salt``."""
    params: Any
    """``SamplingParams(max_tokens=1, extra_args={"dynsteer_capture": key})``."""


@dataclass(frozen=True)
class CapturePlan:
    """A validated capture split into passes (sites) and rounds (prompts)."""

    ticket: str
    prompts: list[list[int]]
    reduce: Reduce
    hidden_size: int
    passes: list[list[str]]
    """Sites (``hook@layer``, forward order) of each pass; at most capture_lanes each."""
    rounds: list[list[int]]
    """Prompt indices of each round; their lengths sum to at most capture_tokens."""

    @property
    def sites(self) -> list[str]:
        return [site for sites in self.passes for site in sites]

    def pass_ticket(self, pass_index: int) -> str:
        return f"{self.ticket}.{pass_index}"

    def round_items(self, pass_index: int, round_index: int) -> list[CaptureItem]:
        ticket = self.pass_ticket(pass_index)
        items = []
        for i in self.rounds[round_index]:
            key = capture_key(ticket, i)
            params = vllm_frontend.one_token_params({CAPTURE_KEY: key})
            prompt = {"prompt_token_ids": self.prompts[i], "cache_salt": f"dynsteer-capture:{key}"}
            items.append(CaptureItem(index=i, key=key, request_id=f"dynsteer-capture-{key}",
                                     prompt=prompt, params=params))
        return items


def plan_capture(prompts: list[list[int]], args: CaptureArgs, frontend: Any) -> CapturePlan:
    """Check token prompts and sites against the engine and split them into passes and rounds.

    ``frontend`` is the engine's ``FrontendState`` (monitor sites, layers, options).
    """
    lanes, capacity = frontend.options.capture_lanes, frontend.options.capture_tokens
    if lanes == 0:
        raise ValueError("activation capture is off on this engine (dynsteer.capture_lanes is "
                         "0); restart it with capture_lanes >= 1")
    sites = resolve_sites(args.sites, frontend.num_layers, field="sites")
    if not sites:
        raise ValueError("sites: no site given")
    for site in sites:
        if site not in frontend.monitors:
            raise ValueError(f"sites: {unmonitored_site(site)}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}]: empty prompt")
        if len(prompt) > capacity:
            raise ValueError(
                f"prompts[{i}]: {len(prompt)} tokens exceed the capture capacity of {capacity} "
                "tokens; raise dynsteer.capture_tokens (engine option) or shorten the prompt"
            )
    names = [site_name(s) for s in sites]
    rounds: list[list[int]] = [[]]
    used = 0
    for i, prompt in enumerate(prompts):
        if used + len(prompt) > capacity:
            rounds.append([])
            used = 0
        rounds[-1].append(i)
        used += len(prompt)
    return CapturePlan(
        ticket=secrets.token_hex(8), prompts=prompts, reduce=args.reduce,
        hidden_size=frontend.hidden_size,
        passes=[names[k:k + lanes] for k in range(0, len(names), lanes)], rounds=rounds,
    )


class _Assembler:
    """Collects the workers' replies into per-site arrays, checking every piece arrived."""

    def __init__(self, plan: CapturePlan) -> None:
        self._plan = plan
        self._rows: dict[str, list[np.ndarray | None]] = {
            site: [None] * len(plan.prompts) for site in plan.sites}

    def add(self, items: list[CaptureItem], replies: list[Any]) -> None:
        index = {item.key: item.index for item in items}
        answers = [_CaptureReply.model_validate(r) for r in replies if r is not None]
        if not answers:
            raise RuntimeError("no worker returned captured activations (is dynsteer active "
                               "on this engine?)")
        hidden = self._plan.hidden_size
        for answer in answers:
            for key, why in answer.missing.items():
                raise RuntimeError(f"capture of prompts[{index.get(key, key)}] failed on the "
                                   f"engine: {why}")
            for key, item in answer.items.items():
                i = index[key]
                per_site = item.tokens if answer.reduce == "all" else 1
                if len(item.data) % F32.itemsize:
                    raise RuntimeError(f"capture of prompts[{i}]: {len(item.data)} bytes is not "
                                       "a whole number of float32 values")
                values = np.frombuffer(item.data, dtype=F32).astype(np.float32)  # writable
                expected = len(answer.sites) * per_site * hidden
                if values.size != expected or item.tokens != len(self._plan.prompts[i]):
                    raise RuntimeError(f"capture of prompts[{i}]: got {values.size} floats for "
                                       f"{item.tokens} tokens, expected {expected}")
                data = values.reshape(len(answer.sites), per_site, hidden)
                for lane, site in enumerate(answer.sites):
                    self._rows[site][i] = data[lane]

    def result(self) -> CaptureResult:
        out: CaptureResult = {}
        for site, rows in self._rows.items():
            absent = [i for i, r in enumerate(rows) if r is None]
            if absent:
                raise RuntimeError(f"capture: no data for site {site} of prompts{absent[:8]}")
            arrays = [r for r in rows if r is not None]
            out[site] = arrays if self._plan.reduce == "all" else np.stack([r[0] for r in arrays])
        return out


# ---- the protocol, and its two drivers ---------------------------------------------------
@dataclass(frozen=True)
class _Rpc:
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _Generate:
    items: list[CaptureItem]


_Step = _Rpc | _Generate


def _protocol(plan: CapturePlan) -> Generator[_Step, Any, CaptureResult]:
    """The engine calls of one capture; each ``yield`` gets the call's result back.

    A driver that fails on a call throws the exception in here, so the pass is always ended.
    """
    assembler = _Assembler(plan)
    for p, sites in enumerate(plan.passes):
        try:
            yield _Rpc("dynsteer_capture_begin", (plan.pass_ticket(p), sites))
            for r in range(len(plan.rounds)):
                items = plan.round_items(p, r)
                yield _Generate(items)
                replies = yield _Rpc("dynsteer_capture_collect",
                                     ([item.key for item in items], plan.reduce))
                assembler.add(items, replies)
        finally:
            yield _Rpc("dynsteer_capture_end", (plan.pass_ticket(p),))
    return assembler.result()


def _drive(protocol: Generator[_Step, Any, CaptureResult],
           execute: Callable[[_Step], Any]) -> CaptureResult:
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = protocol.send(reply) if error is None else protocol.throw(error)
        except StopIteration as done:
            return done.value
        try:
            reply, error = execute(step), None
        except BaseException as e:  # handed to the protocol, which ends the pass and re-raises
            reply, error = None, e


async def _drive_async(protocol: Generator[_Step, Any, CaptureResult],
                       execute: Callable[[_Step], Awaitable[Any]]) -> CaptureResult:
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = protocol.send(reply) if error is None else protocol.throw(error)
        except StopIteration as done:
            return done.value
        try:
            reply, error = await execute(step), None
        except BaseException as e:  # cancellation included: the pass still ends
            reply, error = None, e


# ---- entry points ------------------------------------------------------------------------
_locks_guard = threading.Lock()
_sync_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_async_locks: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


def _lock(table: weakref.WeakKeyDictionary[Any, Any], engine: Any, make: Callable[[], Any]) -> Any:
    with _locks_guard:
        lock = table.get(engine)
        if lock is None:
            lock = table[engine] = make()
        return lock


def _frontend(engine: Any) -> Any:
    state = vllm_frontend.engine_state(engine)
    if state is None:
        raise RuntimeError(
            "dynsteer is not enabled on this engine: pass additional_config={'dynsteer': {}}")
    return state


def _encode_texts(prompts: list[list[int] | str], tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.encode(p)) if isinstance(p, str) else p for p in prompts]


def _no_tokenizer(args: CaptureArgs, error: Exception) -> ValueError:
    first = next(i for i, p in enumerate(args.prompts) if isinstance(p, str))
    return ValueError(f"prompts[{first}]: a text prompt needs the engine's tokenizer, which is "
                      f"not available ({error}); pass token ids")


def capture_sync(llm: Any, prompts: Any, sites: Any, reduce: Any = "last") -> CaptureResult:
    """Capture activations with an offline ``vllm.LLM`` (blocks; see the module docstring)."""
    frontend = _frontend(llm)
    args = parse_args(prompts, sites, reduce)
    token_prompts = args.prompts
    if any(isinstance(p, str) for p in token_prompts):
        try:
            tokenizer = llm.get_tokenizer()
        except Exception as e:
            raise _no_tokenizer(args, e) from e
        token_prompts = _encode_texts(token_prompts, tokenizer)
    plan = plan_capture(token_prompts, args, frontend)  # type: ignore[arg-type]

    def execute(step: _Step) -> Any:
        if isinstance(step, _Rpc):
            return vllm_frontend.rpc(llm, step.method, step.args)
        llm.generate([item.prompt for item in step.items], [item.params for item in step.items],
                     use_tqdm=False)
        return None

    with _lock(_sync_locks, llm, threading.Lock):
        return _drive(_protocol(plan), execute)


async def capture_async(engine_client: Any, prompts: Any, sites: Any,
                        reduce: Any = "last") -> CaptureResult:
    """Capture activations with an ``AsyncLLM`` (the API server's engine client).

    Text prompts are tokenized with ``engine_client.get_tokenizer()`` in a worker thread;
    engines started without a tokenizer take token ids only. Raises ``ValueError`` for bad
    arguments (message starts with the field: a 4xx), ``RuntimeError`` when the engine could
    not capture. Cancelling the task aborts the capture's requests and ends its pass.
    """
    frontend = _frontend(engine_client)
    args = parse_args(prompts, sites, reduce)
    token_prompts = args.prompts
    if any(isinstance(p, str) for p in token_prompts):
        try:
            tokenizer = engine_client.get_tokenizer()
            if inspect.isawaitable(tokenizer):  # a coroutine in older vLLM versions
                tokenizer = await tokenizer
        except Exception as e:
            raise _no_tokenizer(args, e) from e
        token_prompts = await asyncio.to_thread(_encode_texts, token_prompts, tokenizer)
    plan = plan_capture(token_prompts, args, frontend)  # type: ignore[arg-type]

    async def execute(step: _Step) -> Any:
        if isinstance(step, _Rpc):
            return await vllm_frontend.rpc_async(engine_client, step.method, step.args)
        with acting_as(TRUSTED):  # the frontend's own requests carry its reserved key
            tasks = [asyncio.ensure_future(_drain(engine_client.generate(
                item.prompt, item.params, item.request_id))) for item in step.items]
        try:
            await asyncio.gather(*tasks)
        finally:  # on failure or cancellation, abort the rest (vLLM aborts cancelled streams)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return None

    async with _lock(_async_locks, engine_client, asyncio.Lock):
        return await _drive_async(_protocol(plan), execute)


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


def encode_result(result: CaptureResult) -> dict[str, Any]:
    """A capture result as JSON: per site, ``{"dtype", "shape", "data"}`` (base64, little-endian
    float32) for ``last``/``mean``, a list of those (one per prompt) for ``all``."""

    def one(array: np.ndarray) -> dict[str, Any]:
        return {"dtype": "float32", "shape": list(array.shape), "data": encode_f32(array)}

    return {site: [one(a) for a in value] if isinstance(value, list) else one(value)
            for site, value in result.items()}


__all__ = ["REDUCES", "CaptureArgs", "CapturePlan", "CaptureResult", "capture_async",
           "capture_sync", "encode_result", "parse_args", "plan_capture"]
