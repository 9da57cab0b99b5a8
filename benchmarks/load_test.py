"""Reliability under load (issue 16): `dynsteer serve` under mixed concurrent traffic with
registry churn, beside plain vLLM; and a long soak with aborts, disconnects and preemptions.

Load (default). One server at a time (the machine may have 2 cores): `dynsteer serve`, then
plain vLLM on the same model with no plugin loaded at all (``VLLM_PLUGINS=""``), each driven
by the same request stream from ``--concurrency`` client tasks: half streaming, half not;
``/v1/completions`` (with ``logprobs: 1``) and some ``/v1/chat/completions``; plain, static
(distinct inline vectors, half as ``vector_b64``), a registered vector, gated (a registered
probe, and distinct inline probes), the ``latch`` controller, sessions (steered and cleared
over the ZeroMQ command socket while the run goes on) and requests naming vectors and probes
that a side thread registers, replaces and deletes during the run. Plain vLLM gets the same
requests without the ``dynsteer`` field. Checked: zero 5xx, zero transport errors, every
answer well formed (the token count asked for, finite logprobs, a ``[DONE]``), the only 4xx
being requests that named a vector or probe just deleted, the server alive, its steering rows
back to their idle value; reported: latency percentiles (total, and TTFT when streaming) of
both servers.

Leakage. vLLM's greedy output is not batch invariant (the CPU build has no batch-invariant
mode: its attention backend says so and its worker never enables it), so a plain request under
load is compared with itself sent alone afterwards by the logprobs of its first
``--compare-tokens`` tokens (up to and including the first position where the two texts
diverge, a near-tie). The same comparison runs on the plugin-free server: its rate of
deviations above ``--tolerance`` is vLLM's own, ours must not be higher (and is required to
be zero at the default tolerance). As a yardstick, the same prompts sent alone with a static
steering vector of norm 4 at one layer show how large a steering leak would be. Steered
requests whose steering stays fixed during the run and does not depend on the schedule
(static, named, gated; not ``latch``, see :data:`STEERED_KINDS`) are compared with themselves
alone the same way: a request given another request's row would differ.

Soak (``--soak N``). One `dynsteer serve` with a small KV cache (``--kv-blocks`` blocks of 32
tokens, so that the scheduler preempts) and few probe rows (``max_gates`` 8); N requests of the
same mix, longer generations, a fraction (``--abort-fraction``) dropped by the client: streams
closed after a few chunks, non-streaming requests cancelled after a random delay (both are a
client disconnect to the server). Rows in use and live steered requests are read from
``/metrics`` before and after (when the engine is idle again) and must match; preemptions
must have happened (``vllm:num_preemptions_total``); afterwards 8 requests with 8 new
inline probes that gate every token run at once, and each must report its gate (a probe row
leaked in the workers would leave one ungated). The resident memory of the server and its
descendants (EngineCore, worker) is sampled every ``--rss-every`` requests; growth from the
first sample after the warm-up (10%) to the last is reported, and growth over the last third
(after bounded caches filled) must stay under ``--max-rss-growth-mib``. ``--plugin-free`` runs
the same soak, unsteered, on plain vLLM: its memory is the yardstick.

Prints a table (markdown) and writes ``load.json`` / ``soak.json`` and the server logs to
``--out``; exits 1 when a check fails.

Usage: PYTHONPATH=tests python benchmarks/load_test.py --out DIR [--requests 1000]
       [--concurrency 32] [--soak N]      (the tests' tiny chat model)
       python benchmarks/load_test.py --out DIR --model PATH ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from serving import plain_vllm

from dynsteer.controller.contract import encode_f32
from dynsteer.controller.launch import ServerProcess, free_port

KEY = "load-key"
SERVED = "load"
VECTOR_NORM = 4.0
"""Norm of every steering vector (the tests' vectors: a visible change on the tiny model)."""
SESSIONS = 4
CHURN_PREFIX = "churn-"
DEFAULT_TOLERANCE = 1e-4
"""Largest |Δ logprob| between a plain request under load and alone that counts as equal.
On the tiny fp32 model both servers give bit-identical logprobs under 32-way load (0 of 40
differ at all), while a norm-4 steering vector at one layer moves them by 1e-2 and more; a
larger model may need ``--tolerance`` set from the plugin-free server's own deviations."""
KIND_MIX = ("plain",) * 6 + ("chat", "static", "static", "static_b64", "static_b64", "named",
                             "gated", "gated", "gated_inline", "latch", "latch", "session",
                             "session", "churn")
"""One request in 20 of each kind listed (plain: 6, so 35% of the stream is unsteered)."""
WORDS = ("sea", "ship", "storm", "harbour", "wind", "sail", "island", "map", "gold", "night",
         "light", "rope", "wave", "deck", "captain", "crew", "river", "stone", "bird", "song")


# ---- the model and the request stream ----------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the request stream needs to know of the served model (read from config.json, so
    the plugin-free server gets the very same stream)."""

    hidden: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, model: Path) -> Shape:
        config = json.loads((Path(model) / "config.json").read_text())
        config = config.get("text_config", config)
        return cls(int(config["hidden_size"]), int(config["num_hidden_layers"]),
                   int(config["vocab_size"]))

    @property
    def monitor(self) -> int:
        """The layer of the default monitor site ``post_block@50%``."""
        return min(self.layers - 1, self.layers // 2)


def default_model() -> Path:
    """The tests' tiny chat model (a 4-layer random Llama with SmolLM2's tokenizer and chat
    template) at its stable path, so vLLM's compile cache of the test runs is reused. Its
    makers are the tests' helpers: run with ``PYTHONPATH=tests`` (or give ``--model``)."""
    try:
        from server_utils import make_chat_model
        from tiny_models import stable_model_dir
    except ImportError:
        raise SystemExit("the default model is the tests' tiny chat model: run from the "
                         "repository root with PYTHONPATH=tests, or give --model DIR") from None

    return stable_model_dir("tiny-chat", make_chat_model, "chat")


def unit(rng: np.random.Generator, hidden: int, norm: float) -> np.ndarray:
    v = rng.standard_normal(hidden)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


@dataclass
class Item:
    """One request of the stream: its route, body and what the client does with it."""

    index: int
    kind: str
    stream: bool
    route: str
    body: dict[str, Any]
    max_tokens: int
    abort_after_chunks: int | None = None
    """Streaming: close the connection after this many chunks (a client disconnect)."""
    abort_after_s: float | None = None
    """Non-streaming: cancel the request after this many seconds (a client disconnect)."""

    @property
    def aborts(self) -> bool:
        return self.abort_after_chunks is not None or self.abort_after_s is not None


def spec_for(kind: str, i: int, rng: np.random.Generator, shape: Shape,
             pool: dict[str, list[np.ndarray]]) -> dict[str, Any] | None:
    """The ``dynsteer`` field of a request of ``kind`` (None: plain; a ``churn`` spec is
    replaced when sent by one naming what is registered at that moment)."""
    mon, last = shape.monitor, shape.layers - 1
    gated_layers = sorted({mon, last})
    layers = sorted({int(x) for x in rng.choice(shape.layers, size=2)})
    phase = ("all", "prefill", "decode")[i % 3]
    if kind == "static":
        return {"steer": [{"vector": pool["static"][i % len(pool["static"])].tolist(),
                           "layers": layers, "phase": phase}]}
    if kind == "static_b64":
        return {"steer": [{"vector_b64": encode_f32(pool["static"][(i + 7) % len(pool["static"])]),
                           "layers": layers, "phase": phase}]}
    if kind == "named":
        return {"steer": [{"vector": "load-vec", "layers": layers, "scale": 0.5 + i % 3}]}
    if kind in ("gated", "latch"):
        spec: dict[str, Any] = {"gate": {"probe": "load-probe", "layer": mon,
                                         "steer": [{"vector": "load-vec",
                                                    "layers": gated_layers}]}}
        if kind == "latch":
            spec["controller"] = {"name": "latch", "k": 2}
        return spec
    if kind == "gated_inline":
        j = i % len(pool["probe"])
        return {"gate": {"probe": {"weights_b64": encode_f32(pool["probe"][j]),
                                   "threshold": 0.0},
                         "layer": mon, "steer": [{"vector_b64": encode_f32(pool["gated"][j]),
                                                  "layers": [last]}]}}
    if kind == "session":
        spec = {"session": f"sess-{i % SESSIONS}"}
        if i % 2:
            spec["gate"] = {"probe": "load-probe", "layer": mon,
                            "steer": [{"vector": "load-vec", "layers": [last]}]}
        return spec
    if kind == "churn":
        return churn_spec(0, shape)
    return None


def churn_spec(j: int, shape: Shape) -> dict[str, Any]:
    """A spec naming the churn thread's ``j``-th vector and probe (they may be gone)."""
    return {"steer": [{"vector": f"{CHURN_PREFIX}v{j}", "layers": [shape.monitor]}],
            "gate": {"probe": f"{CHURN_PREFIX}p{j}", "layer": shape.monitor,
                     "steer": [{"vector": f"{CHURN_PREFIX}v{j}", "layers": [shape.layers - 1]}]}}


def build_workload(n: int, shape: Shape, *, seed: int = 0, prompt_len: tuple[int, int] = (8, 48),
                   gen_len: tuple[int, int] = (8, 24), abort_fraction: float = 0.0,
                   chat: bool = True) -> list[Item]:
    """``n`` requests of :data:`KIND_MIX` in a seeded random order, half of each kind
    streaming; ``abort_fraction`` of them dropped by the client part way."""
    rng = np.random.default_rng(seed)
    pool = {"static": [unit(rng, shape.hidden, VECTOR_NORM) for _ in range(48)],
            "gated": [unit(rng, shape.hidden, VECTOR_NORM) for _ in range(16)],
            "probe": [unit(rng, shape.hidden, 1.0) for _ in range(16)]}
    kinds = [KIND_MIX[i % len(KIND_MIX)] for i in range(n)]
    rng.shuffle(kinds)
    if not chat:
        kinds = ["plain" if k == "chat" else k for k in kinds]
    seen: Counter[str] = Counter()
    items = []
    for i, kind in enumerate(kinds):
        stream = bool(seen[kind] % 2)
        seen[kind] += 1
        max_tokens = int(rng.integers(gen_len[0], gen_len[1] + 1))
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        body: dict[str, Any] = {"model": SERVED, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            route = "/v1/chat/completions"
            words = rng.choice(len(WORDS), size=max(3, length // 3))
            body["messages"] = [{"role": "user", "content": " ".join(WORDS[w] for w in words)}]
        else:
            route = "/v1/completions"
            body["prompt"] = rng.integers(100, min(shape.vocab, 49152) - 100, length).tolist()
            body["logprobs"] = 1
        spec = spec_for(kind, i, rng, shape, pool)
        if spec is not None:
            body["dynsteer"] = spec
        item = Item(i, kind, stream, route, body, max_tokens)
        if rng.random() < abort_fraction:
            if stream:
                item.abort_after_chunks = int(rng.integers(1, 4))
            else:
                item.abort_after_s = float(rng.uniform(0.02, 0.4))
        items.append(item)
    return items


def without_steering(items: Sequence[Item]) -> list[Item]:
    """The same stream for a plugin-free server: no ``dynsteer`` field anywhere."""
    out = []
    for item in items:
        body = {k: v for k, v in item.body.items() if k != "dynsteer"}
        out.append(Item(item.index, item.kind, item.stream, item.route, body, item.max_tokens,
                        item.abort_after_chunks, item.abort_after_s))
    return out


# ---- sending one request ---------------------------------------------------------------
@dataclass
class Outcome:
    """What happened to one request, as the client saw it."""

    index: int
    kind: str
    stream: bool
    status: int = 0
    """HTTP status (0: no answer: connection refused, reset or timed out)."""
    error: str | None = None
    """Why the answer is not acceptable (None: it is)."""
    rejected: bool = False
    """An expected 4xx: the request named a churn vector or probe that was just deleted."""
    in_stream_error: bool = False
    """The error came inside a 200 event stream (vLLM admits a streaming request after its
    response started, so a spec error there is an error event, not an HTTP status)."""
    event_code: int | None = None
    """The status an in-stream error event carries."""
    aborted: bool = False
    start: float = 0.0
    """When it was sent (``time.perf_counter``)."""
    ttft: float | None = None
    total: float | None = None
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_id: str | None = None


def _check(item: Item, out: Outcome, finish: str | None, usage: dict | None) -> str | None:
    """Why a complete 200 answer is malformed (None: it is well formed)."""
    if finish != "length":
        return f"finish_reason {finish!r} (ignore_eos: expected 'length')"
    if not usage or usage.get("completion_tokens") != item.max_tokens:
        return f"usage {usage!r}: expected {item.max_tokens} completion tokens"
    if "logprobs" in item.body:
        if len(out.tokens) != item.max_tokens or len(out.logprobs) != item.max_tokens:
            return f"{len(out.logprobs)} logprobs for {item.max_tokens} tokens"
        if not all(isinstance(x, float) and math.isfinite(x) and x <= 1e-6
                   for x in out.logprobs):
            return "logprobs not finite or positive"
    return None


def _take_choice(choice: dict[str, Any], out: Outcome) -> None:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens") is not None:
        out.tokens.extend(logprobs["tokens"])
        out.logprobs.extend(logprobs["token_logprobs"])


async def send(client: Any, base: str, item: Item,
               churn: Callable[[], dict[str, Any]] | None = None) -> Outcome:
    """Send ``item`` (a churn item with the spec ``churn()`` gives now) and judge the answer;
    never raises (a client-side abort is ``aborted``)."""
    import httpx

    out = Outcome(item.index, item.kind, item.stream)
    body = item.body
    if item.kind == "churn" and churn is not None and "dynsteer" in body:
        body = {**body, "dynsteer": churn()}
    t0 = out.start = time.perf_counter()
    try:
        if item.stream:
            await _stream(client, base, item, body, out, t0)
        else:
            request = client.post(base + item.route, json=body)
            if item.abort_after_s is not None:
                try:
                    response = await asyncio.wait_for(request, item.abort_after_s)
                except asyncio.TimeoutError:
                    out.aborted = True
                    return out
            else:
                response = await request
            out.status = response.status_code
            out.total = time.perf_counter() - t0
            if out.status != 200:
                _judge_error(out, response.text)
                return out
            data = response.json()
            out.response_id = data.get("id")
            choice = (data.get("choices") or [{}])[0]
            _take_choice(choice, out)
            out.error = _check(item, out, choice.get("finish_reason"), data.get("usage"))
    except httpx.HTTPError as e:
        out.error = f"transport: {type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:
        out.error = f"malformed answer: {type(e).__name__}: {e}"
    return out


async def _stream(client: Any, base: str, item: Item, body: dict[str, Any], out: Outcome,
                  t0: float) -> None:
    finish: str | None = None
    usage: dict | None = None
    done = False
    chunks = 0
    async with client.stream("POST", base + item.route, json=body) as response:
        out.status = response.status_code
        if out.status != 200:
            _judge_error(out, (await response.aread()).decode(errors="replace"))
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.in_stream_error = True
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                _judge_error(out, json.dumps(chunk), error.get("code"))
                return
            out.response_id = out.response_id or chunk.get("id")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if "role" in (choice.get("delta") or {}):
                    continue  # the chat stream's opening chunk carries no token
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                _take_choice(choice, out)
                finish = choice.get("finish_reason") or finish
                chunks += 1
            if item.abort_after_chunks is not None and chunks >= item.abort_after_chunks:
                out.aborted = True
                return  # leaving the block closes the connection mid-stream
    out.total = time.perf_counter() - t0
    out.error = "stream ended without [DONE]" if not done else _check(item, out, finish, usage)


def _judge_error(out: Outcome, text: str, code: Any = None) -> None:
    """An error answer (``code``: the status an in-stream error event carries) is expected
    only for a churn request that named a vector or probe just deleted."""
    if code is not None:
        out.event_code = int(code) if isinstance(code, int) else 500
    status = out.status if code is None else out.event_code
    if status == 400 and CHURN_PREFIX in text and out.kind == "churn":
        out.rejected = True
    elif code is not None:
        out.error = f"error event in a {out.status} stream: {text[:300]}"
    else:
        out.error = f"HTTP {out.status}: {text[:300]}"


async def drive(base: str, items: Sequence[Item], concurrency: int,
                churn: Callable[[], dict[str, Any]] | None = None,
                on_done: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], float]:
    """Send ``items`` from ``concurrency`` concurrent client tasks; (outcomes, seconds)."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    # Every request on a connection of its own (no keep-alive pool): a request sent on an idle
    # connection that the server is closing at that instant fails with a ReadError and no
    # answer, nothing in the server's log. A client race, not a server fault; it was seen once
    # in 20,000 requests with the pool's expiry at 5 s, and again in a 500-request CI soak with
    # the expiry at 1 s (the client's loop can run late on a loaded 2-core machine, so its idle
    # clock is behind the server's). A fresh connection cannot meet a server-side close of an
    # idle one, so a transport error left here is the server's. A loopback connect costs
    # ~0.1 ms a request.
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits,
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:

        async def one(item: Item) -> Outcome:
            async with semaphore:
                result = await send(client, base, item, churn)
            if on_done is not None:
                on_done(result)
            return result

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(item) for item in items))
        return list(outcomes), time.perf_counter() - t0


# ---- registry and session churn during the run ------------------------------------------
class Churn:
    """A thread that registers, replaces and deletes vectors and probes, and sets and clears
    session steering over the command socket, until stopped. ``current`` is the index whose
    names were registered last (what churn requests name)."""

    def __init__(self, base: str, shape: Shape, commands: str | None, period_s: float = 0.25):
        self.base, self.shape, self.commands, self.period_s = base, shape, commands, period_s
        self.current = 0
        self.ops: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._rng = np.random.default_rng(99)

    def spec(self) -> dict[str, Any]:
        """What a churn request names now (the last registered vector and probe)."""
        return churn_spec(self.current, self.shape)

    def __enter__(self) -> Churn:
        self.register(0)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stop, and delete what is still registered (the registry returns to its size)."""
        self._stop.set()
        self._thread.join(timeout=120)
        self.delete(self.current)

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        from dynsteer.controller.client import DynsteerHTTPError

        try:
            fn()
            self.ops[what] += 1
        except DynsteerHTTPError as e:
            self.failures.append(f"{what}: HTTP {e.status}: {e.message[:200]}")
        except OSError as e:
            self.failures.append(f"{what}: {type(e).__name__}: {e}")

    def register(self, j: int, replace: bool = False) -> None:
        from dynsteer.controller.client import DynsteerClient
        from dynsteer.probes import Probe, ProbeSite

        client = DynsteerClient(self.base, api_key=KEY)
        vector = unit(self._rng, self.shape.hidden, VECTOR_NORM)
        probe = Probe(name=f"{CHURN_PREFIX}p{j}", weights=unit(self._rng, self.shape.hidden, 1.0),
                      site=ProbeSite(layer=self.shape.monitor))
        self._call("register_vector", lambda: client.register_vector(
            f"{CHURN_PREFIX}v{j}", vector, replace=replace))
        self._call("register_probe", lambda: client.upload_probe(probe, replace=replace))

    def delete(self, j: int) -> None:
        from dynsteer.controller.client import DynsteerClient

        client = DynsteerClient(self.base, api_key=KEY)
        self._call("delete_vector", lambda: client.delete_vector(f"{CHURN_PREFIX}v{j}"))
        self._call("delete_probe", lambda: client.delete_probe(f"{CHURN_PREFIX}p{j}"))

    def _session(self, dealer: Any, j: int) -> None:
        from dynsteer.controller.zmq_protocol import ClearSession, Reply, SetSession, encode

        session = f"sess-{j % SESSIONS}"
        if j % 2:
            command: Any = SetSession(id=str(j), session=session, api_key=KEY, steer=[
                {"vector": "load-vec", "layers": [self.shape.monitor], "scale": 1.0}])
        else:
            command = ClearSession(id=str(j), session=session, api_key=KEY)
        dealer.send(encode(command))
        if not dealer.poll(30_000):
            self.failures.append(f"{command.type}: no reply in 30 s")
            return
        import msgspec

        reply = Reply.model_validate(msgspec.msgpack.decode(dealer.recv()))
        if reply.ok:
            self.ops[command.type] += 1
        else:
            self.failures.append(f"{command.type}: {reply.error}")

    def _run(self) -> None:
        dealer = None
        if self.commands is not None:
            import zmq

            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.commands)
        j = 0
        try:
            while not self._stop.wait(self.period_s):
                j += 1
                self.register(j)
                self.current = j
                if j % 3 == 0:
                    self.register(j, replace=True)
                self.delete(j - 1)
                if dealer is not None:
                    self._session(dealer, j)
        finally:
            if dealer is not None:
                dealer.close()


# ---- the server: flags, metrics, memory --------------------------------------------------
def register_fixtures(base: str, shape: Shape) -> None:
    """The named vector and probe the stream uses (``load-vec``, ``load-probe``)."""
    from dynsteer.controller.client import DynsteerClient
    from dynsteer.probes import Probe, ProbeSite

    rng = np.random.default_rng(5)
    client = DynsteerClient(base, api_key=KEY)
    client.register_vector("load-vec", unit(rng, shape.hidden, VECTOR_NORM), replace=True)
    client.upload_probe(Probe(name="load-probe", weights=unit(rng, shape.hidden, 1.0),
                              site=ProbeSite(layer=shape.monitor)), replace=True)


def serve_args(model: Path, *, max_num_seqs: int, dtype: str = "float32",
               extra: Sequence[str] = ()) -> list[str]:
    """The engine flags both servers share."""
    return [str(model), "--dtype", dtype, "--max-model-len", "256", "--max-num-seqs",
            str(max_num_seqs), "--seed", "0", "--served-model-name", SERVED, *extra]


def dynsteer_args(folder: Path, engine: dict[str, Any] | None = None) -> tuple[list[str], str]:
    """dynsteer's own flags (API key, command socket, engine options), and the socket."""
    commands = f"tcp://127.0.0.1:{free_port()}"
    args = ["--dynsteer-api-key", KEY, "--dynsteer-commands", commands]
    if engine:
        config = folder / "dynsteer-config.json"
        config.write_text(json.dumps({"engine": engine}))
        args += ["--dynsteer-config", str(config)]
    return args, commands


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` as {name: value summed over label sets} (dynsteer's worker counters are
    refreshed by the scrape itself)."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=60) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            values[name] = values.get(name, 0.0) + float(value)
    return values


IDLE_KEYS = ("dynsteer_rows_in_use", "dynsteer_steered_requests_live",
             "vllm:num_requests_running", "vllm:num_requests_waiting",
             "dynsteer_vectors_registered", "dynsteer_probes_registered")
"""What must be back at its idle value once the engine has nothing to do."""


def wait_idle(base: str, timeout: float = 180.0) -> dict[str, float]:
    """The metrics once vLLM reports no running or waiting request (aborted requests are
    finished asynchronously); raises if that does not happen in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(base)
        if (metrics.get("vllm:num_requests_running", 0) == 0
                and metrics.get("vllm:num_requests_waiting", 0) == 0):
            time.sleep(1.0)  # let the last step's frees reach the workers, then read again
            return scrape(base)
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine not idle after {timeout:.0f} s: "
                               f"{ {k: metrics.get(k) for k in IDLE_KEYS} }")
        time.sleep(1.0)


def idle_state(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics.get(k, 0.0) for k in IDLE_KEYS}


def memory(pid: int) -> dict[str, int]:
    """Resident KiB of ``pid`` and its descendants, by process name (``VLLM::Worker``, ...)."""
    import psutil  # vLLM's own dependency

    root = psutil.Process(pid)
    out: dict[str, int] = {}
    for process in (root, *root.children(recursive=True)):
        try:
            name, rss = process.name(), process.memory_info().rss // 1024
        except psutil.Error:
            continue
        key = "api_server" if process.pid == pid else name
        out[key] = out.get(key, 0) + rss
    return out


def log_problems(log: Path) -> dict[str, int]:
    """Counts of lines in a server log that mean trouble, before the server was told to stop
    (stopping it aborts its engine, which vLLM logs as a dead engine)."""
    text = log.read_text(errors="replace").split("[shutdown]", 1)[0]
    return {"traceback": text.count("Traceback (most recent call last)"),
            "error_lines": sum(" ERROR " in line or line.startswith("ERROR")
                               for line in text.splitlines()),
            "engine_dead": text.count("EngineDeadError") + text.count("Engine core proc"),
            "rows_full": text.count("steering rows are in use"),
            "probe_rows_full": text.count("probe rows are in use")}


# ---- leakage -----------------------------------------------------------------------------
def deviation(a: Outcome, b: Outcome, k: int) -> tuple[float, int | None]:
    """(largest |Δ logprob| over the first ``k`` tokens up to and including the first position
    where the tokens differ, that position or None). Past a divergence the two requests see
    different prefixes, so later positions are not comparable."""
    n = min(k, len(a.logprobs), len(b.logprobs))
    if n == 0:
        return math.inf, 0
    first = next((j for j in range(n) if a.tokens[j] != b.tokens[j]), None)
    upto = n if first is None else first + 1
    return max(abs(a.logprobs[j] - b.logprobs[j]) for j in range(upto)), first


def alone(item: Item, spec: dict[str, Any] | None = None) -> Item:
    """``item`` as a single non-streaming request (with ``spec`` as its steering)."""
    body = {k: v for k, v in item.body.items() if k not in ("stream", "stream_options")}
    if spec is not None:
        body["dynsteer"] = spec
    return Item(item.index, item.kind, False, item.route, body, item.max_tokens)


STEERED_KINDS = ("static", "static_b64", "named", "gated", "gated_inline")
"""Steered kinds whose steering does not change during the run (not sessions or churn) and does
not depend on how vLLM schedules them: each must also equal itself alone (a request given
another's row would not). Not ``latch``: a controller decides per step, so a latched request
that was preempted and recomputed, or whose prompt was chunked, is steered differently from
the same request alone (README, "Controllers"; seen in CI as one latch request 5e-3 off)."""


def leak_sample(items: Sequence[Item], outcomes: Sequence[Outcome], n: int,
                kinds: Sequence[str] = ("plain",)) -> list[int]:
    """Indices of ``n`` completions of ``kinds`` spread over the run that completed, in run
    order: an equal share of each kind (the first kinds take the remainder), so a rare kind
    is always in the sample; a kind with fewer completions than its share gives the rest to
    the others."""
    ok = {kind: [] for kind in kinds}
    for it, out in zip(items, outcomes, strict=True):
        if it.kind in ok and out.error is None and not out.aborted and out.logprobs:
            ok[it.kind].append(it.index)
    quota = {kind: len(done) for kind, done in ok.items()}
    if sum(quota.values()) > n:
        quota = dict.fromkeys(kinds, 0)
        left = n
        while left:  # one more for each kind that still has completions, in turn
            for kind in kinds:
                if left and quota[kind] < len(ok[kind]):
                    quota[kind] += 1
                    left -= 1
    picked = [done[int(j)] for kind, done in ok.items() if quota[kind]
              for j in np.linspace(0, len(done) - 1, quota[kind])]
    return sorted(picked)


async def compare_alone(base: str, items: Sequence[Item], outcomes: Sequence[Outcome],
                        sample: Sequence[int], k: int, tolerance: float,
                        control_spec: dict[str, Any] | None = None,
                        controls: int = 8) -> dict[str, Any]:
    """Send each sampled request again, alone (with its own steering, if any), and compare
    it with its answer under load; with ``control_spec``, also the first ``controls`` of them
    with that steering instead, alone."""
    by_index = {it.index: it for it in items}
    loaded = {out.index: out for out in outcomes}
    alone_out = [(await drive(base, [alone(by_index[i])], 1))[0][0] for i in sample]
    errors = [o.error for o in alone_out if o.error]
    devs, divergent = [], 0
    for i, out in zip(sample, alone_out, strict=True):
        dev, first = deviation(loaded[i], out, k)
        devs.append(dev)
        divergent += first is not None
    result: dict[str, Any] = {
        "sample": len(sample), "compare_tokens": k, "tolerance": tolerance,
        "errors": errors[:5], "above_tolerance": int(sum(d > tolerance for d in devs)),
        "token_divergent": divergent, "max_dev": max(devs, default=0.0),
        "median_dev": float(np.median(devs)) if devs else 0.0, "devs": devs}
    if control_spec is not None:
        steered = [(await drive(base, [alone(by_index[i], control_spec)], 1))[0][0]
                   for i in sample[:controls]]
        cdevs = [deviation(plain, s, k)[0]
                 for plain, s in zip(alone_out, steered, strict=False) if s.error is None]
        result["steered_min_dev"] = min(cdevs, default=math.nan)
        result["steered_median_dev"] = float(np.median(cdevs)) if cdevs else math.nan
        result["steered_errors"] = [s.error for s in steered if s.error][:3]
    return result


# ---- summaries ---------------------------------------------------------------------------
def summarize(outcomes: Sequence[Outcome], wall: float) -> dict[str, Any]:
    """Counts of what happened, and latency percentiles (ms) of the completed requests."""
    done = [o for o in outcomes if o.error is None and not o.aborted and not o.rejected]
    total = np.array([o.total for o in done if o.total is not None]) * 1e3
    ttft = np.array([o.ttft for o in done if o.stream and o.ttft is not None]) * 1e3

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if a.size else math.nan

    errors = [o for o in outcomes if o.error is not None]
    by_kind = {}
    for kind in sorted({o.kind for o in done}):
        ms = np.array([o.total for o in done if o.kind == kind and o.total is not None]) * 1e3
        by_kind[kind] = {"n": int(ms.size), "total_ms_p50": pct(ms, 50),
                         "total_ms_p99": pct(ms, 99)}
    t0 = min((o.start for o in outcomes), default=0.0)
    return {
        "requests": len(outcomes), "completed": len(done), "wall_s": wall,
        "requests_per_s": len(done) / wall if wall else math.nan,
        "status": dict(Counter(str(o.status) for o in outcomes if not o.aborted)),
        "http_5xx": sum(o.status >= 500 or (o.event_code or 0) >= 500 for o in outcomes),
        "transport_errors": sum(o.status == 0 and o.error is not None for o in outcomes),
        "malformed_or_unexpected": len(errors),
        "first_errors": [f"#{o.index} {o.kind}: {o.error}" for o in errors[:5]],
        "expected_4xx": sum(o.rejected for o in outcomes),
        "expected_4xx_in_stream": sum(o.rejected and o.in_stream_error for o in outcomes),
        "aborted": sum(o.aborted for o in outcomes),
        "by_kind": dict(Counter(o.kind for o in outcomes)),
        "total_ms_p50": pct(total, 50), "total_ms_p99": pct(total, 99),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "latency_by_kind": by_kind,
        "per_request": [[o.index, o.kind, o.stream, o.status, round(o.start - t0, 4),
                         None if o.total is None else round(o.total * 1e3, 2),
                         None if o.ttft is None else round(o.ttft * 1e3, 2),
                         o.aborted, o.rejected] for o in outcomes],
    }


# ---- the load run ------------------------------------------------------------------------
@contextlib.contextmanager
def dynsteer_server(model: Path, out: Path, name: str, *, max_num_seqs: int, dtype: str,
                    extra: Sequence[str] = (), engine: dict[str, Any] | None = None
                    ) -> Iterator[tuple[ServerProcess, str]]:
    """`dynsteer serve` with the shared flags plus ours; yields (server, command socket)."""
    own, commands = dynsteer_args(out, engine)
    server = ServerProcess(serve_args(model, max_num_seqs=max_num_seqs, dtype=dtype,
                                      extra=[*extra, *own]),
                           out / f"serve_{name}.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        server.wait_ready(timeout=900)
        yield server, commands
    finally:
        server.stop()


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load comparison: `dynsteer serve` with churn, then plain vLLM, same stream."""
    shape = Shape.of(args.model)
    items = build_workload(args.requests, shape, seed=args.seed)
    warmup = build_workload(2 * args.concurrency, shape, seed=args.seed + 1)
    control = {"steer": [{"vector": unit(np.random.default_rng(17), shape.hidden,
                                         VECTOR_NORM).tolist(), "layers": [shape.monitor]}]}
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}}

    t_start = time.perf_counter()
    with dynsteer_server(args.model, args.out, "dynsteer", max_num_seqs=args.concurrency,
                         dtype=args.dtype) as (server, commands):
        startup = time.perf_counter() - t_start
        register_fixtures(server.url, shape)
        baseline = idle_state(scrape(server.url))
        warm, warm_wall = asyncio.run(drive(server.url, warmup, args.concurrency))
        wait_idle(server.url)
        mem_before = memory(server.proc.pid)
        with Churn(server.url, shape, commands) as churn:
            outcomes, wall = asyncio.run(drive(server.url, items, args.concurrency,
                                               churn.spec))
        after = idle_state(wait_idle(server.url))
        sample = leak_sample(items, outcomes, args.sample)
        leak = asyncio.run(compare_alone(server.url, items, outcomes, sample,
                                         args.compare_tokens, args.tolerance, control))
        steered_sample = leak_sample(items, outcomes, args.sample, STEERED_KINDS)
        steered_leak = asyncio.run(compare_alone(server.url, items, outcomes, steered_sample,
                                                 args.compare_tokens, args.tolerance))
        results["dynsteer"] = {
            **summarize(outcomes, wall), "startup_s": startup, "leakage": leak,
            "steered_vs_alone": steered_leak,
            "warmup": summarize(warm, warm_wall),
            "churn_ops": dict(churn.ops), "churn_failures": churn.failures[:10],
            "idle_before": baseline, "idle_after": after,
            "rss_kib_before": mem_before, "rss_kib_after": memory(server.proc.pid),
            "alive": server.proc.poll() is None, "log": log_problems(server.log),
        }

    if not args.skip_plain:
        plain_items = without_steering(items)
        t_start = time.perf_counter()
        with plain_vllm(serve_args(args.model, max_num_seqs=args.concurrency, dtype=args.dtype),
                        args.out / "serve_vllm.log", timeout=900,
                        env={"VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "1"}) as (url, proc):
            startup = time.perf_counter() - t_start
            warm, warm_wall = asyncio.run(drive(url, without_steering(warmup),
                                                args.concurrency))
            outcomes, wall = asyncio.run(drive(url, plain_items, args.concurrency))
            sample = leak_sample(plain_items, outcomes, args.sample)
            leak = asyncio.run(compare_alone(url, plain_items, outcomes, sample,
                                             args.compare_tokens, args.tolerance))
            results["vllm"] = {**summarize(outcomes, wall), "startup_s": startup,
                               "leakage": leak, "alive": proc.poll() is None,
                               "warmup": summarize(warm, warm_wall),
                               "log": log_problems(args.out / "serve_vllm.log")}
    return results


def load_failures(results: dict[str, Any]) -> list[str]:
    """What makes the load run fail."""
    ours = results["dynsteer"]
    fails = _common_failures("dynsteer", ours)
    fails += [f"churn: {f}" for f in ours["churn_failures"]]
    if ours["idle_after"] != ours["idle_before"]:
        fails.append(f"idle state after the run {ours['idle_after']} != before "
                     f"{ours['idle_before']}")
    for what, leak in (("plain", ours["leakage"]), ("steered", ours["steered_vs_alone"])):
        if leak["above_tolerance"] or leak["errors"]:
            fails.append(f"leakage: {leak['above_tolerance']} of {leak['sample']} {what} "
                         f"requests differ from themselves alone by more than "
                         f"{leak['tolerance']:g} (max {leak['max_dev']:.3g}); "
                         f"errors {leak['errors']}")
    if "vllm" in results:
        fails += _common_failures("vllm", results["vllm"])
    return fails


def _common_failures(name: str, r: dict[str, Any]) -> list[str]:
    fails = []
    for part, counts in ((name, r), (f"{name} warm-up", r["warmup"])):
        if counts["http_5xx"] or counts["transport_errors"] or counts["malformed_or_unexpected"]:
            fails.append(f"{part}: {counts['http_5xx']} 5xx, {counts['transport_errors']} "
                         f"transport errors, {counts['malformed_or_unexpected']} bad answers: "
                         f"{counts['first_errors']}")
    if not r["alive"]:
        fails.append(f"{name}: the server died")
    if r["log"]["engine_dead"]:
        fails.append(f"{name}: the engine core died (see its log)")
    return fails


def load_table(results: dict[str, Any]) -> str:
    """The markdown table of a load run."""
    rows = [("server", "requests", "5xx", "bad", "expected 4xx", "req/s", "total p50 ms",
             "total p99 ms", "TTFT p50 ms", "TTFT p99 ms",
             "plain vs alone: > tol / sample", "max abs dlogprob", "token-divergent",
             "steered vs alone: > tol / sample")]
    for name in ("dynsteer", "vllm"):
        if name not in results:
            continue
        r, leak = results[name], results[name]["leakage"]
        rows.append((
            "dynsteer serve" if name == "dynsteer" else "vLLM, no plugin",
            str(r["requests"]), str(r["http_5xx"] + r["transport_errors"]),
            str(r["malformed_or_unexpected"]), str(r["expected_4xx"]),
            f"{r['requests_per_s']:.1f}", f"{r['total_ms_p50']:.0f}", f"{r['total_ms_p99']:.0f}",
            f"{r['ttft_ms_p50']:.0f}", f"{r['ttft_ms_p99']:.0f}",
            f"{leak['above_tolerance']} / {leak['sample']}", f"{leak['max_dev']:.2g}",
            f"{leak['token_divergent']} / {leak['sample']}",
            f"{r['steered_vs_alone']['above_tolerance']} / {r['steered_vs_alone']['sample']}"
            if "steered_vs_alone" in r else "n/a"))
    return _markdown(rows)


def _markdown(rows: Sequence[Sequence[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


# ---- the soak ----------------------------------------------------------------------------
PROBE_CHECK = 8
"""``max_gates`` of the soak server, and the concurrent freshly-gated requests after it."""


async def probe_rows_check(base: str, shape: Shape, n: int = PROBE_CHECK) -> list[str]:
    """``n`` requests at once, each gated by a new inline probe that fires on every token;
    each must report its gate. A probe row leaked on the workers leaves one of them without
    a row (it runs ungated); one leaked in the scheduler's row budget leaves it waiting."""
    import httpx

    rng = np.random.default_rng(1234)
    items = []
    for i in range(n):
        spec = {"gate": {"probe": {"weights": unit(rng, shape.hidden, 1.0).tolist(),
                                   "threshold": -1e3},
                         "layer": shape.monitor,
                         "steer": [{"vector": unit(rng, shape.hidden, VECTOR_NORM).tolist(),
                                    "layers": [shape.layers - 1]}]}}
        body = {"model": SERVED, "prompt": rng.integers(100, 1000, 32).tolist(),
                "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "dynsteer": spec}
        items.append(Item(i, "probe_check", False, "/v1/completions", body, 16))
    outcomes, _ = await asyncio.wait_for(drive(base, items, n), 300)
    problems = [f"probe check #{o.index}: {o.error}" for o in outcomes if o.error]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60) as client:
        for o in outcomes:
            if o.response_id is None:
                continue
            r = await client.get(f"{base}/v1/dynsteer/requests/{o.response_id}")
            report = r.json() if r.status_code == 200 else {}
            telemetry = report.get("telemetry") or {}
            if not report.get("gated") or not telemetry.get("gated_prefill"):
                problems.append(f"probe check #{o.index}: ran without its gate "
                                f"(HTTP {r.status_code}: {json.dumps(report)[:200]})")
    return problems


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """N requests with aborts and preemptions; rows and memory before and after (with
    ``--plugin-free``: the same stream, unsteered, on plain vLLM, for its memory)."""
    shape = Shape.of(args.model)
    items = build_workload(args.soak, shape, seed=args.seed, prompt_len=(16, 64),
                           gen_len=(16, 40), abort_fraction=args.abort_fraction)
    warmup = build_workload(4 * args.concurrency, shape, seed=args.seed + 1, prompt_len=(16, 64),
                            gen_len=(16, 40), abort_fraction=args.abort_fraction)
    extra = ["--block-size", "32", "--num-gpu-blocks-override", str(args.kv_blocks)]
    rss_every = args.rss_every or max(25, args.soak // 40)
    if args.plugin_free:
        engine_args = serve_args(args.model, max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                                 extra=extra)
        log = args.out / "serve_soak_vllm.log"
        with plain_vllm(engine_args, log, timeout=900,
                        env={"VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "1"}) as (url, proc):
            return soak_on(url, proc, log, None, shape, without_steering(items),
                           without_steering(warmup), args.concurrency, rss_every, steered=False)
    with dynsteer_server(args.model, args.out, "soak", max_num_seqs=args.max_num_seqs,
                         dtype=args.dtype, extra=extra,
                         engine={"max_gates": PROBE_CHECK}) as (server, commands):
        return soak_on(server.url, server.proc, server.log, commands, shape, items, warmup,
                       args.concurrency, rss_every)


def soak_on(url: str, proc: Any, log: Path, commands: str | None, shape: Shape,
            items: list[Item], warmup: list[Item], concurrency: int, rss_every: int,
            steered: bool = True) -> dict[str, Any]:
    """The soak on a running server ``proc`` at ``url`` (shared with ``tests/test_load.py``);
    ``steered=False``: a plugin-free server (no registry, churn or probe rows to check)."""
    if steered:
        register_fixtures(url, shape)
    fresh = idle_state(wait_idle(url))
    warm, warm_wall = asyncio.run(drive(url, warmup, concurrency))
    before_metrics = wait_idle(url)
    baseline = idle_state(before_metrics)
    samples: list[dict[str, Any]] = [{"done": 0, "rss_kib": memory(proc.pid)}]
    done = 0

    def on_done(_: Outcome) -> None:
        nonlocal done
        done += 1
        if done % rss_every == 0:
            samples.append({"done": done, "rss_kib": memory(proc.pid)})

    with Churn(url, shape, commands) if steered else contextlib.nullcontext() as churn:
        outcomes, wall = asyncio.run(drive(url, items, concurrency,
                                           churn.spec if churn else None, on_done))
    after_metrics = wait_idle(url)
    after = idle_state(after_metrics)
    probe_problems = asyncio.run(probe_rows_check(url, shape)) if steered else []
    final = idle_state(wait_idle(url))
    samples.append({"done": done, "rss_kib": memory(proc.pid), "final": True})
    return {
        **summarize(outcomes, wall), "warmup": summarize(warm, warm_wall), "steered": steered,
        "preemptions": after_metrics.get("vllm:num_preemptions_total", 0.0)
        - before_metrics.get("vllm:num_preemptions_total", 0.0),
        "idle_fresh": fresh, "idle_before": baseline, "idle_after": after,
        "idle_after_probe_check": final, "probe_check_problems": probe_problems,
        "churn_ops": dict(churn.ops) if churn else {},
        "churn_failures": churn.failures[:10] if churn else [],
        "rss": rss_growth(samples, warm_fraction=0.1, total=len(items)), "rss_samples": samples,
        "alive": proc.poll() is None, "log": log_problems(log),
    }


def rss_growth(samples: Sequence[dict[str, Any]], warm_fraction: float,
               total: int) -> dict[str, dict[str, float]]:
    """Per process: resident MiB at the first sample past the warm-up and at the last, the
    growth between, and the growth over the last third of the run. Bounded caches fill during
    the run (the workers keep the telemetry of the last 4096 steered requests, the frontend
    the reports of as many), so growth that stops is expected; the last third, after they
    filled, says whether memory keeps growing. The slope (MiB per 1000 requests, least squares
    over the samples past the warm-up) tells a trend from a step."""
    warm = [s for s in samples if s["done"] >= warm_fraction * total] or list(samples)
    out = {}
    for name in warm[-1]["rss_kib"]:
        points = [(s["done"], s["rss_kib"][name] / 1024) for s in warm if name in s["rss_kib"]]
        xs = np.array([x for x, _ in points], dtype=float)
        ys = np.array([y for _, y in points])
        late = ys[xs >= xs[-1] - (xs[-1] - xs[0]) / 3] if xs.size else ys
        slope = float(np.polyfit(xs, ys, 1)[0] * 1000) if len(set(xs)) > 1 else 0.0
        out[name] = {"first_mib": float(ys[0]), "last_mib": float(ys[-1]),
                     "growth_mib": float(ys[-1] - ys[0]), "max_mib": float(ys.max()),
                     "late_growth_mib": float(late[-1] - late[0]),
                     "slope_mib_per_1000": slope}
    return out


def soak_failures(r: dict[str, Any], max_rss_growth_mib: float) -> list[str]:
    """What makes a soak fail."""
    fails = _common_failures("soak", r)
    fails += [f"churn: {f}" for f in r["churn_failures"]]
    fails += r["probe_check_problems"]
    for key in IDLE_KEYS:
        values = [r[k][key] for k in ("idle_fresh", "idle_before", "idle_after",
                                      "idle_after_probe_check")]
        if len(set(values)) != 1:
            fails.append(f"{key} did not return to its idle value: fresh, before, after, "
                         f"after the probe check = {values}")
    if r["preemptions"] <= 0:
        fails.append("no preemption happened: lower --kv-blocks")
    if not r["aborted"]:
        fails.append("no request was aborted")
    for name, g in r["rss"].items():
        if g["late_growth_mib"] > max_rss_growth_mib:
            fails.append(f"{name} grew by {g['late_growth_mib']:.0f} MiB over the last third "
                         f"of the soak (limit {max_rss_growth_mib:g})")
    return fails


def soak_table(r: dict[str, Any]) -> str:
    rows = [("requests", "aborted by the client", "5xx", "bad", "preemptions", "req/s",
             "rows in use: idle before / after", "live steered: before / after",
             "probe rows (8 fresh gates after)")]
    rows.append((str(r["requests"]), str(r["aborted"]), str(r["http_5xx"] + r["transport_errors"]),
                 str(r["malformed_or_unexpected"]), f"{r['preemptions']:.0f}",
                 f"{r['requests_per_s']:.1f}",
                 f"{r['idle_before']['dynsteer_rows_in_use']:.0f} / "
                 f"{r['idle_after']['dynsteer_rows_in_use']:.0f}",
                 f"{r['idle_before']['dynsteer_steered_requests_live']:.0f} / "
                 f"{r['idle_after']['dynsteer_steered_requests_live']:.0f}",
                 "n/a (no plugin)" if not r.get("steered", True) else
                 "all gated" if not r["probe_check_problems"] else
                 f"{len(r['probe_check_problems'])} problems"))
    mem = [("process", "RSS after warm-up MiB", "RSS at end MiB", "growth MiB",
            "growth over the last third MiB", "slope MiB / 1000 requests")]
    for name, g in r["rss"].items():
        mem.append((name, f"{g['first_mib']:.0f}", f"{g['last_mib']:.0f}",
                    f"{g['growth_mib']:+.1f}", f"{g['late_growth_mib']:+.1f}",
                    f"{g['slope_mib_per_1000']:+.2f}"))
    return _markdown(rows) + "\n\n" + _markdown(mem)


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None,
                    help="model folder (default: the tests' tiny chat model, with "
                         "PYTHONPATH=tests)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=40, help="plain requests replayed alone")
    ap.add_argument("--compare-tokens", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--skip-plain", action="store_true", help="no plugin-free comparison")
    ap.add_argument("--plugin-free", action="store_true",
                    help="soak: run it on plain vLLM (no plugin; its memory, for comparison)")
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="run the soak with N requests instead of the load comparison")
    ap.add_argument("--abort-fraction", type=float, default=0.2)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="soak server")
    ap.add_argument("--kv-blocks", type=int, default=16,
                    help="soak server: KV blocks of 32 tokens (small: preemptions)")
    ap.add_argument("--rss-every", type=int, default=0,
                    help="soak: sample memory every N requests (default N/40)")
    ap.add_argument("--max-rss-growth-mib", type=float, default=32.0,
                    help="soak: largest growth of a process over the last third")
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.soak:
        result = run_soak(args)
        result["config"] = {k: str(v) for k, v in vars(args).items()}
        fails = soak_failures(result, args.max_rss_growth_mib)
        table, name = soak_table(result), "soak"
    else:
        result = run_load(args)
        fails = load_failures(result)
        table, name = load_table(result), "load"
    result["failures"] = fails
    result["seconds"] = time.perf_counter() - t0
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=_json))
    (args.out / f"{name}.md").write_text(table + "\n")
    print(table)
    print(f"\n{name}: {result['seconds']:.0f} s; "
          + ("OK" if not fails else "FAILED:\n  " + "\n  ".join(fails)))
    return 1 if fails else 0


def _json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
