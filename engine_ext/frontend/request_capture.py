"""A request's own activations: what the frontend tells the workers, and what comes back.

A spec's ``capture`` (:class:`~dynsteer.controller.spec.CaptureSpec`) asks for the residual
stream at some monitor sites at the positions the engine computes for the request. At
admission the frontend checks it against the engine (its sites are monitor sites, the capture
lanes hold them, the request's rows fit) and writes :data:`ACTIVATIONS_KEY` for the workers:
the sites, how many rows the request may fill (its prompt plus ``max_tokens - 1``: the last
generated token's forward never runs), the positions and the dtype. The workers store the rows
in the graph's capture buffer as the request runs (:mod:`..worker.capture_buffers`) and keep
them after it finishes until they are collected (:func:`collect_args`, :func:`merge`, through
``Steering.activations`` or a completion's response) or a later request needs the room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from dynsteer.controller.activations import Activations, rows_from_bytes, value_bytes
from dynsteer.controller.activations import merge as merge_parts
from dynsteer.controller.contract import site_name
from dynsteer.controller.limits import SpecError
from dynsteer.controller.positions import first_prompt_position, select
from dynsteer.controller.spec import CaptureSpec, ModelShape, capture_sites

from ..compat import frontend as vllm_frontend
from ..compat.frontend import Generation
from ..options import EngineOptions
from . import rows_inbox


def admit(capture: CaptureSpec, shape: ModelShape, options: EngineOptions, prompt_len: int,
          generation: Generation, sinks: frozenset[str] = frozenset(),
          prefix: str = "dynsteer.capture") -> dict[str, Any]:
    """What the workers read (:data:`ACTIVATIONS_KEY`), or a SpecError naming the field."""
    sites = capture_sites(capture, shape, prefix)
    if capture.sink is not None and capture.sink not in sinks | options.capture_sinks.keys():
        known = ", ".join(sorted(sinks | options.capture_sinks.keys())) or "none"
        raise SpecError(f"{prefix}.sink: {capture.sink!r} is not a capture sink here "
                        f"(configured: {known}; the engine option dynsteer.capture_sinks "
                        "NAME=DIR, or dynsteer serve --dynsteer-capture-sinks NAME=DIR)")
    max_tokens = generation.max_tokens
    if options.capture_lanes == 0:
        raise SpecError(f"{prefix}: activation capture is off on this engine "
                        "(dynsteer.capture_lanes is 0); restart it with capture_lanes >= 1")
    if len(sites) > options.capture_lanes:
        raise SpecError(f"{prefix}.sites: {len(sites)} sites; this engine captures at most "
                        f"{options.capture_lanes} sites at once (dynsteer.capture_lanes)")
    if max_tokens is None:
        raise SpecError(f"{prefix}: set max_tokens (the request's capture rows are its prompt "
                        "plus max_tokens - 1)")
    rows = prompt_len + max(max_tokens, 1) - 1
    n = max(generation.n, 1)
    if rows * n > options.capture_tokens:
        each = f"{n} completions x " if n > 1 else ""
        raise SpecError(
            f"{prefix}: the request needs {rows * n} capture rows ({each}prompt {prompt_len} + "
            f"max_tokens {max_tokens} - 1); this engine holds {options.capture_tokens} "
            "(dynsteer.capture_tokens): lower max_tokens, or restart the engine with more")
    if capture.sink is None:
        _check_bytes(capture, len(sites), shape.hidden_size, prompt_len, rows, n, options,
                     prefix)
    return {"sites": [site_name(site) for site in sites], "rows": rows,
            "positions": capture.positions, "dtype": capture.dtype, "when": capture.when,
            "window": list(capture.window) if capture.window is not None else None,
            "project": capture.project.model_dump() if capture.project is not None else None,
            "reduce": capture.reduce, "stream": capture.streams,
            "sink": capture.sink if capture.sink in options.capture_sinks else None}


def _check_bytes(capture: CaptureSpec, sites: int, hidden: int, prompt_len: int, rows: int,
                 n: int, options: EngineOptions, prefix: str) -> None:
    """SpecError when the rows the request may return (``n`` completions') exceed
    ``capture_max_bytes``."""
    positions = 1 if capture.reduce == "mean" else len(select(capture.positions, prompt_len,
                                                               rows))
    width = capture.project.k if capture.project is not None else hidden
    row = width * value_bytes(capture.dtype) + (4 if capture.dtype == "int8" else 0)
    nbytes = n * sites * positions * row
    if nbytes > options.capture_max_bytes:
        each = f"{n} completions x " if n > 1 else ""
        raise SpecError(
            f"{prefix}: the request may return {nbytes} bytes of activations ({each}{sites} "
            f"sites x {positions} positions x {row} bytes); this engine returns at most "
            f"{options.capture_max_bytes} per capture (dynsteer.capture_max_bytes): capture "
            "fewer sites or positions, a smaller dtype or a projection, or name a capture "
            "sink")


def first_captured_prompt_position(capture: CaptureSpec | None, prompt_len: int) -> int | None:
    """The first prompt position the request must compute itself (None: it may take every
    cached block). vLLM always computes the last prompt position, so capturing only that one
    needs no fork."""
    if capture is None:
        return None
    first = first_prompt_position(capture.positions, prompt_len)
    return first if first is not None and first < prompt_len - 1 else None


def collect_args(requests: Sequence[tuple[str, int | None] | tuple[str, int | None, int]],
                 keep: bool = False) -> tuple[Any, ...]:
    """The arguments of ``dynsteer_collect_activations`` for ``requests`` ((id, computed) or
    (id, computed, since): the first position not yet collected)."""
    return ([[r[0], r[1], r[2] if len(r) > 2 else 0] for r in requests],
            rows_inbox.inbox(), keep)


def collect(llm: Any, requests: list[tuple[str, int | None]]) -> list[Activations | None]:
    """The activations of ``requests`` ((id, computed)) from an offline ``vllm.LLM``'s
    workers (freed there), one result per request."""
    return merge(vllm_frontend.rpc(llm, "dynsteer_collect_activations", collect_args(requests)),
                 len(requests))


async def collect_async(engine_client: Any, requests: list[tuple[str, int | None]]
                        ) -> list[Activations | None]:
    """:func:`collect` through an ``AsyncLLM``."""
    return await collect_through(
        lambda method, *args: vllm_frontend.rpc_async(engine_client, method, args), requests)


async def collect_through(rpc: Callable[..., Awaitable[list[Any]]],
                          requests: Sequence[tuple[str, int | None]
                                             | tuple[str, int | None, int]],
                          keep: bool = False) -> list[Activations | None]:
    """The activations of ``requests`` (see :func:`collect_args`) through ``rpc(method,
    *args)``, an async call of every worker. Cancelling the caller lets the call finish (the
    workers free the rows either way) and removes the inbox files of its replies, which
    nobody will read."""
    task = asyncio.ensure_future(rpc("dynsteer_collect_activations",
                                     *collect_args(requests, keep)))
    try:
        replies = await asyncio.shield(task)
        for reply in replies:
            for path in _files(reply):
                await rows_inbox.ready(path)
    except asyncio.CancelledError:
        task.add_done_callback(_discard_files)
        raise
    return merge(replies, len(requests))


def _discard_files(task: asyncio.Future[list[Any]]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    for reply in task.result():
        for path in _files(reply):
            rows_inbox.discard(path)


def _files(reply: dict[str, Any] | None) -> list[str]:
    """The inbox files of a worker's reply (none: its rows are inline)."""
    if reply is None or not reply.get("file"):
        return []
    return rows_inbox.parts(reply["file"], int(reply.get("parts", 1)))


def merge(replies: list[dict[str, Any] | None], count: int) -> list[Activations | None]:
    """The workers' replies to ``dynsteer_collect_activations`` of ``count`` requests as one
    result per request (a pipeline stage's replier has its own layers' sites; None: the
    request asked for no capture)."""
    parts: list[list[Activations]] = [[] for _ in range(count)]
    files = [_take(reply) for reply in replies]  # every file first: none is left behind
    for reply, file in zip(replies, files, strict=True):
        if reply is None:
            continue
        for i, item in enumerate(reply["items"]):
            if item is None:
                continue
            failed = next((f for f in file if isinstance(f, OSError)), None)
            if failed is not None:
                parts[i].append(Activations(status="dropped", positions=np.zeros(0, np.int64),
                                            sites={}, dtype=item["dtype"], detail=str(failed)))
            else:
                parts[i].append(decode(item, file[int(item.get("part", 0))] if file else None))
    return [merge_parts(p) for p in parts]


def _take(reply: dict[str, Any] | None) -> list[np.ndarray | OSError]:
    """The bytes of each of a reply's inbox files (the error for one the worker could not
    write)."""
    found: list[np.ndarray | OSError] = []
    for path in _files(reply):
        try:
            found.append(rows_inbox.take(path))
        except OSError as e:
            found.append(e)
    return found


def decode(reply: dict[str, Any], file: np.ndarray | None = None) -> Activations:
    """One worker's reply for one request
    (:meth:`..worker.capture_buffers.CaptureBuffers.collect_requests`); ``file``: the bytes of
    the reply's inbox file, where its rows are when it gives an ``offset``."""
    positions = np.frombuffer(reply["positions"], dtype="<i8").astype(np.int64)
    shape = (len(reply["sites"]), int(reply.get("rows", len(positions))), int(reply["hidden"]))
    if "offset" in reply and file is not None:
        data = file[int(reply["offset"]):int(reply["offset"]) + int(reply["nbytes"])]
    else:
        data = reply["data"]
    rows = rows_from_bytes(data, reply["dtype"], shape, reply.get("scales", b""))
    return Activations(status=reply["status"], positions=positions,
                       sites={site: rows[i] for i, site in enumerate(reply["sites"])},
                       dtype=reply["dtype"], detail=reply.get("detail", ""))
