"""Activation capture for training probes (frontend; no network code): prompts in, the
residual stream at some sites out, reduced per prompt.

For a list of prompts, researchers get the stream at some monitor sites (``hook@layer``),
reduced per prompt: ``last`` (last prompt token), ``mean`` (over the prompt tokens) or ``all``
(every prompt token), as float32 numpy arrays.

It is a client of per-request capture (:mod:`.request_capture`), the path every request's
``capture`` takes: each prompt runs as a request with ``max_tokens=1`` whose spec captures its
prompt positions (``last_prompt`` for ``last``; with ``reduce: "mean"``, averaged on the device,
for ``mean``), and its rows are collected as any request's are. So captures run concurrently
with each other and with traffic, share the engine's scheduler with it, and the prefix cache is
handled as for any capturing request: a prompt computes every position it captures. What is
captured is the stream as the engine serves it: global steering, when set, applies to capture
prompts too.

The work is split into *passes* of at most ``dynsteer.capture_lanes`` sites (a request
captures at most that many) and *rounds* of prompts whose lengths sum to at most
``dynsteer.capture_tokens`` (the rows the engine holds), each round collected before the next
runs. A prompt whose rows another request took meanwhile (status ``dropped``: concurrent
captures filled the rows or held the lanes) runs again in a later round, after a wait that
grows while no prompt gets through (:data:`STALLS`, :data:`BACKOFF_S`).

The sequence of engine calls is written once, as a generator (:func:`_protocol`) that yields
each round to run; :func:`capture_sync` (offline ``vllm.LLM``, used by ``Steering.capture``)
and :func:`capture_async` (``AsyncLLM``, the API server's engine client) only execute them.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynsteer.controller.activations import Activations
from dynsteer.controller.contract import encode_f32, resolve_sites, site_name, unmonitored_site
from dynsteer.controller.extra_args import SPEC_KEY

from ..compat import frontend as vllm_frontend
from . import request_capture

Reduce = Literal["last", "mean", "all"]

CaptureResult = dict[str, np.ndarray | list[np.ndarray]]
"""Per site (``hook@layer``): ``[N, H]`` for ``last``/``mean``, a list of N ``[len_i, H]``
arrays for ``all`` (float32, prompts in the order given)."""

STALLS = 8
"""Attempts in a row in which no prompt got its rows (each ``dropped``: other capturing requests
held the rows or lanes) before a capture fails."""
BACKOFF_S = 0.05
"""Wait before running dropped prompts again, doubled for each attempt in a row that made no
progress (0.05 s after one that did; 25 s in all before a capture fails)."""


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
    """One request of a round: prompt ``index`` captured at one pass's sites."""

    index: int
    request_id: str
    prompt: dict[str, Any]
    """A ``TokensPrompt`` dict."""
    params: Any
    """``SamplingParams(max_tokens=1)`` whose spec captures the prompt positions."""


@dataclass(frozen=True)
class CapturePlan:
    """A validated capture split into passes (sites); rounds are formed as prompts run."""

    ticket: str
    """Unique to this capture (its requests' ids)."""
    prompts: list[list[int]]
    reduce: Reduce
    capacity: int
    """Prompt tokens per round (``dynsteer.capture_tokens``)."""
    passes: list[list[str]]
    """Sites (``hook@layer``, forward order) of each pass; at most capture_lanes each."""

    @property
    def sites(self) -> list[str]:
        return [site for sites in self.passes for site in sites]

    def rounds(self, indices: list[int]) -> list[list[int]]:
        """``indices`` (prompts) in rounds whose lengths sum to at most the capacity."""
        rounds: list[list[int]] = [[]]
        used = 0
        for i in indices:
            if rounds[-1] and used + len(self.prompts[i]) > self.capacity:
                rounds.append([])
                used = 0
            rounds[-1].append(i)
            used += len(self.prompts[i])
        return rounds

    def items(self, pass_index: int, indices: list[int], attempt: int) -> list[CaptureItem]:
        positions = "last_prompt" if self.reduce == "last" else "prompt"
        spec: dict[str, Any] = {"sites": self.passes[pass_index], "positions": positions}
        if self.reduce == "mean":
            spec["reduce"] = "mean"
        return [CaptureItem(
            index=i, request_id=f"dynsteer-capture-{self.ticket}.{pass_index}.{attempt}:{i}",
            prompt={"prompt_token_ids": self.prompts[i]},
            params=vllm_frontend.one_token_params({SPEC_KEY: {"capture": spec}}))
            for i in indices]


def plan_capture(prompts: list[list[int]], args: CaptureArgs, frontend: Any) -> CapturePlan:
    """Check token prompts and sites against the engine and split the sites into passes.

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
    rows = sum(map(len, prompts)) if args.reduce == "all" else len(prompts)
    nbytes = rows * len(sites) * frontend.hidden_size * 4
    if nbytes > frontend.options.capture_max_bytes:
        raise ValueError(
            f"prompts: the capture returns {nbytes} bytes ({rows} rows x {len(sites)} sites x "
            f"{frontend.hidden_size} float32); this engine returns at most "
            f"{frontend.options.capture_max_bytes} per capture (dynsteer.capture_max_bytes): "
            "send fewer prompts or sites per call, reduce 'last' or 'mean', or collect into a "
            "capture sink")
    names = [site_name(s) for s in sites]
    return CapturePlan(ticket=secrets.token_hex(8), prompts=prompts, reduce=args.reduce,
                       capacity=capacity,
                       passes=[names[k:k + lanes] for k in range(0, len(names), lanes)])


class _Assembler:
    """Collects each prompt's rows into per-site arrays, checking every piece arrived."""

    def __init__(self, plan: CapturePlan) -> None:
        self._plan = plan
        self._rows: dict[str, list[np.ndarray | None]] = {
            site: [None] * len(plan.prompts) for site in plan.sites}

    def add(self, pass_index: int, item: CaptureItem, found: Activations) -> None:
        i = item.index
        length = len(self._plan.prompts[i])
        want = [length - 1] if self._plan.reduce == "last" else list(range(length))
        if found.positions.tolist() != want:
            raise RuntimeError(f"capture of prompts[{i}]: the engine returned positions "
                               f"{found.positions.tolist()[:8]}, expected {want[:8]}")
        for site in self._plan.passes[pass_index]:
            if site not in found.sites:
                raise RuntimeError(f"capture of prompts[{i}]: no rows for site {site}")
            rows = found.sites[site]
            if rows.shape[0] != (1 if self._plan.reduce != "all" else length):
                raise RuntimeError(f"capture of prompts[{i}]: {rows.shape[0]} rows for site "
                                   f"{site}")
            self._rows[site][i] = rows

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
class _Round:
    """Run these requests to the end and collect their rows (one result per item)."""

    items: list[CaptureItem]


@dataclass(frozen=True)
class _Free:
    """Collect and discard the rows of these requests (a round that failed or was cancelled)."""

    items: list[CaptureItem]


@dataclass(frozen=True)
class _Wait:
    """Sleep this long (before dropped prompts run again)."""

    seconds: float


_Step = _Round | _Free | _Wait


def _protocol(plan: CapturePlan) -> Generator[_Step, Any, CaptureResult]:
    """The rounds of one capture; each ``yield`` gets the round's results back. A driver that
    fails on a round throws the exception in here, which frees the round's rows first."""
    assembler = _Assembler(plan)
    for p in range(len(plan.passes)):
        pending = list(range(len(plan.prompts)))
        attempt = stalled = 0
        while True:
            dropped: list[tuple[int, str]] = []
            for indices in plan.rounds(pending):
                items = plan.items(p, indices, attempt)
                try:
                    results = yield _Round(items)
                except GeneratorExit:
                    raise
                except BaseException:
                    yield _Free(items)
                    raise
                for item, found in zip(items, results, strict=True):
                    if found is not None and found.status == "dropped":
                        dropped.append((item.index, found.detail))
                    elif found is None or found.status != "ok":
                        why = "no capture" if found is None else f"{found.status}: {found.detail}"
                        raise RuntimeError(f"capture of prompts[{item.index}] failed on the "
                                           f"engine ({why})")
                    else:
                        assembler.add(p, item, found)
            if not dropped:
                break
            stalled = stalled + 1 if len(dropped) == len(pending) else 0
            if stalled == STALLS:
                i, why = dropped[0]
                raise RuntimeError(
                    f"capture of prompts[{i}]: other capturing requests held the engine's "
                    f"capture rows or lanes {STALLS} times in a row ({why}); retry when it is "
                    "less busy, or restart it with more dynsteer.capture_tokens / capture_lanes")
            pending = [i for i, _ in dropped]
            attempt += 1
            yield _Wait(BACKOFF_S * 2 ** stalled)
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
        except BaseException as e:  # handed to the protocol, which frees the round's rows
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
        except BaseException as e:  # cancellation included: the round's rows are freed
            reply, error = None, e


# ---- entry points ------------------------------------------------------------------------
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
        if isinstance(step, _Wait):
            return time.sleep(step.seconds)
        if isinstance(step, _Free):  # the offline LLM names its requests itself
            return None
        outs = llm.generate([item.prompt for item in step.items],
                            [item.params for item in step.items], use_tqdm=False)
        return request_capture.collect(
            llm, [(o.request_id, vllm_frontend.computed_positions(o)) for o in outs])

    return _drive(_protocol(plan), execute)


async def capture_async(engine_client: Any, prompts: Any, sites: Any,
                        reduce: Any = "last") -> CaptureResult:
    """Capture activations with an ``AsyncLLM`` (the API server's engine client).

    Text prompts are tokenized with ``engine_client.get_tokenizer()`` in a worker thread;
    engines started without a tokenizer take token ids only. Raises ``ValueError`` for bad
    arguments (message starts with the field: a 4xx), ``RuntimeError`` when the engine could
    not capture. Cancelling the task aborts the capture's requests and frees their rows.
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
        if isinstance(step, _Wait):
            return await asyncio.sleep(step.seconds)
        if isinstance(step, _Free):
            return await request_capture.collect_async(
                engine_client, [(item.request_id, None) for item in step.items])
        tasks = [asyncio.ensure_future(_last(engine_client.generate(
            item.prompt, item.params, item.request_id))) for item in step.items]
        try:
            outs = await asyncio.gather(*tasks)
        finally:  # on failure or cancellation, abort the rest (vLLM aborts cancelled streams)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return await request_capture.collect_async(
            engine_client, [(item.request_id, vllm_frontend.computed_positions(out))
                            for item, out in zip(step.items, outs, strict=True)])

    return await _drive_async(_protocol(plan), execute)


async def _last(stream: AsyncIterator[Any]) -> Any:
    last = None
    async for out in stream:
        last = out
    return last


def encode_result(result: CaptureResult) -> dict[str, Any]:
    """A capture result as JSON: per site, ``{"dtype", "shape", "data"}`` (base64, little-endian
    float32) for ``last``/``mean``, a list of those (one per prompt) for ``all``."""

    def one(array: np.ndarray) -> dict[str, Any]:
        return {"dtype": "float32", "shape": list(array.shape), "data": encode_f32(array)}

    return {site: [one(a) for a in value] if isinstance(value, list) else one(value)
            for site, value in result.items()}


__all__ = ["BACKOFF_S", "STALLS", "CaptureArgs", "CapturePlan", "CaptureResult", "Reduce",
           "capture_async", "capture_sync", "encode_result", "parse_args", "plan_capture"]
