"""Serving latency over HTTP: `dynsteer serve` vs plain vLLM on the same request stream (GPU).

One server at a time (or all at once, ``--interleave``) on the same Llama-8B-shaped dummy model
(vocabulary and tokenizer of the embedded SmolLM2, so the server can detokenize), then the same
stream of streaming ``/v1/completions`` requests at a fixed arrival rate: 128 random prompt
tokens, 128 generated (``ignore_eos``). The dynsteer server gets a mix: 50% plain, 25% static
(32 distinct inline vectors, base64), 25% gated (a registered probe at layer 16 gating a
registered vector at layers 16-23); plain vLLM gets the same requests without the ``dynsteer``
field, and so does the ``dynsteer-plain`` run (the plugin enabled, nothing steered);
``dynsteer-static`` and ``dynsteer-gated`` get half plain requests and half of that kind.
Reported per server: time to first token and inter-token latency (p50 / p99, ms), completed
requests per second, the admitting step (:mod:`serving_steps`) and, for the dynsteer servers,
the workers' dynsteer host time per hook call (from ``/metrics``).
Prints a table and writes ``serving.json`` and every request's latencies to ``latencies.npz``
(what ``serving_pool.py`` pools over calls).

With ``--interleave SEGMENTS`` every server is up at once and serves each segment of the stream
in turn: the way to compare servers on the lent machines, where a process's host speed differs
by up to 2x from one start to the next, more than the plugin's cost.
``--warmup REQUESTS`` has each server serve that many requests of another stream (the same mix,
other prompts and vectors) before the measured segments: the first ~20 s of load after the
servers start ran slower admitting steps than the rest, and a segment that falls there
measures the start, not the plugin. The warm-up's latencies are reported on their own
(``warmup``), beside plain vLLM's, so a start-up cost of the plugin's stays visible.

Usage: python benchmarks/serving.py --out DIR --tokenizer DIR [--rate 16] [--requests 400]
       [--runs vllm,dynsteer[,dynsteer-plain][,vllm-b]]
       [--repeat N | --interleave SEGMENTS --mem 0.42 [--warmup REQUESTS]
       [--deadline SECONDS]] [--pin-cpus CPUS [CPUS ...]]

``--pin-cpus`` runs each server (and the engine core it starts) on CPUs of its own, one
``taskset -c`` list per server of ``--runs``: placement the same for every server, where under
one shared ``taskset`` the scheduler placed them as it went.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_model import dummy_model
from overhead import GATED_LAYERS, HIDDEN, LLAMA_8B, MONITOR
from serving_steps import admitting_step_ms
from sigterm import exits_on_sigterm

from dynsteer.controller.contract import encode_f32
from dynsteer.controller.launch import free_port

PROMPT_LEN, GEN_LEN = 128, 128
VOCAB = 49152
KEY = "bench-key"


def make_model(tokenizer: Path) -> Path:
    """The Llama-8B-shaped dummy model with the tokenizer's files (:mod:`bench_model`: a path
    that keeps vLLM's compile cache from one call to the next on a warm machine)."""
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    return dummy_model("llama8b-served", {**LLAMA_8B, "vocab_size": VOCAB},
                       [tokenizer / n for n in names if (tokenizer / n).exists()])


MIXES = {"mixed": ("plain", "plain", "static", "gated"), "plain": ("plain",),
         "static": ("plain", "static"), "gated": ("plain", "gated")}
"""Streams by the kind of every i-th request (``i % len``): the mixed stream, plain vLLM's,
and half plain with half of one steered kind (which tells the kinds' costs apart)."""


def requests(n: int, mix: str, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` request bodies of stream ``mix`` (:data:`MIXES`); ``seed`` draws the inline
    vectors and the prompts (0: the measured stream)."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((32, HIDDEN)).astype(np.float32) * 0.01
    gate = {"probe": "bench", "layer": MONITOR,
            "steer": [{"vector": "bench", "layers": GATED_LAYERS}]}
    kinds = MIXES[mix]
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": "bench", "prompt": rng.integers(100, VOCAB - 100, PROMPT_LEN).tolist(),
            "max_tokens": GEN_LEN, "temperature": 0.0, "ignore_eos": True, "stream": True}
        kind = kinds[i % len(kinds)]
        if kind == "static":
            body["dynsteer"] = {"steer": [{"vector_b64": encode_f32(vectors[i % 32]),
                                           "layers": [MONITOR]}]}
        elif kind == "gated":
            body["dynsteer"] = {"gate": gate}
        out.append(body)
    return out


async def one(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {(await response.text())[:200]}"}
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if not stamps:
        return {"error": "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": np.diff(stamps).tolist(), "end": stamps[-1],
            "sent": t0, "stamps": stamps}


async def drive(url: str, bodies: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, body)))
        results = await asyncio.gather(*tasks)
    errors = [r["error"] for r in results if "error" in r]
    done = [r for r in results if "error" not in r]
    span = max(r["end"] for r in done) - t0
    kinds = [kind_of(b) for b, r in zip(bodies, results, strict=True) if "error" not in r]
    by_kind = {k: latencies([r for r, rk in zip(done, kinds, strict=True) if rk == k])
               for k in sorted(set(kinds))}
    for r, kind in zip(done, kinds, strict=True):  # the run's clock starts at its first send
        r["sent"], r["stamps"], r["kind"] = r["sent"] - t0, np.array(r["stamps"]) - t0, kind
    return {"requests": len(bodies), "errors": len(errors), "first_errors": errors[:3],
            **latencies(done), ADMIT: admitting_step_ms(done),
            "requests_per_s": len(done) / span, "by_kind": by_kind, "_done": done}


def kind_of(body: dict[str, Any]) -> str:
    """``plain``, ``static`` or ``gated``: what the dynsteer server was asked for (plain vLLM
    gets every body as ``plain``)."""
    spec = body.get("dynsteer")
    return "plain" if spec is None else ("gated" if "gate" in spec else "static")


def latencies(done: list[dict[str, Any]]) -> dict[str, float]:
    """TTFT and inter-token latency p50 / p99 (ms) of the requests ``done``."""
    ttft = np.array([r["ttft"] for r in done]) * 1e3
    itl = np.array([x for r in done for x in r["itl"]]) * 1e3
    return {"ttft_ms_p50": float(np.percentile(ttft, 50)),
            "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "itl_ms_p50": float(np.percentile(itl, 50)),
            "itl_ms_p99": float(np.percentile(itl, 99))}


ADMIT = "admit_step_ms_p50"
"""A load's admitting step (:func:`serving_steps.admitting_step_ms`); in ``ratios`` the ratio
of the loads' means."""


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 480.0) -> None:
    """Until ``url`` answers 200 (raises when ``proc`` exits or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError("server did not start")


def serve_args(model: Path, mem: float) -> list[str]:
    """The servers' common arguments."""
    return [str(model), "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", str(PROMPT_LEN + GEN_LEN + 16), "--max-num-seqs", "256",
            "--gpu-memory-utilization", str(mem), "--served-model-name", "bench",
            "--seed", "0"]


@contextlib.contextmanager
def server_process(cmd: list[str], health: str, log: Path, env: dict[str, str] | None = None,
                   timeout: float = 480.0, cpus: str | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """``cmd`` (a server taking ``--port`` and ``--host``) on a free loopback port, its log in
    ``log``: yields (its URL, the process) once ``health`` answers; stopped on exit, with
    every process of its group (an engine core its server left behind included). ``env``
    is added to this process's environment. ``cpus`` (a ``taskset -c`` list): the server
    and the processes it starts run on those CPUs only."""
    port = free_port()
    cmd = [*cmd, "--port", str(port), "--host", "127.0.0.1"]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
        try:
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            wait_health(url + health, proc, timeout)
            print(f"{log.stem}: up in {time.monotonic() - t0:.0f} s", flush=True)
            yield url, proc
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
            with contextlib.suppress(ProcessLookupError):  # whatever of its group is left
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def plain_vllm(args: list[str], log: Path, env: dict[str, str] | None = None,
               timeout: float = 480.0, **process: Any) -> contextlib.AbstractContextManager[
                   tuple[str, subprocess.Popen]]:
    """Plain vLLM's OpenAI server (``--model ARGS``), as :func:`server_process` runs it
    (``env``: e.g. ``VLLM_PLUGINS=""``, no plugin at all; ``process``: its other keywords)."""
    return server_process([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", *args], "/health", log, env, timeout, **process)


Load = Callable[..., dict[str, Any]]
"""``load(bodies, rate)`` drives a running server with a stream of request bodies at a rate and
returns the run."""


@dataclass(frozen=True)
class Launch:
    """How this benchmark starts a server: its share of GPU memory and the CPUs it runs on (a
    ``taskset -c`` list; None: wherever this process may run)."""

    mem: float
    cpus: str | None = None


@contextlib.contextmanager
def plain_server(model: Path, out: Path, name: str, launch: Launch) -> Iterator[Load]:
    with plain_vllm(serve_args(model, launch.mem), out / f"serve_{name}.log",
                    cpus=launch.cpus) as (url, _):
        def load(bodies: list[dict[str, Any]], rate: float) -> dict[str, Any]:
            return asyncio.run(drive(url, bodies, rate))

        yield load


@contextlib.contextmanager
def dynsteer_server(model: Path, out: Path, name: str, launch: Launch,
                    engine: dict[str, Any]) -> Iterator[Load]:
    """``engine``: the server's dynsteer engine options; the stream's registered vector and
    probe are registered before the first load."""
    from dynsteer.controller.client import DynsteerClient
    from dynsteer.probes import Probe, ProbeSite

    cmd = [sys.executable, "-m", "dynsteer.engine_ext.cli", "serve",
           *serve_args(model, launch.mem),
           "--dynsteer-api-key", KEY,
           "--additional-config", json.dumps({"dynsteer": engine})]
    with server_process(cmd, "/v1/dynsteer/health", out / f"serve_{name}.log",
                        cpus=launch.cpus) as (url, _):
        client = DynsteerClient(url, api_key=KEY)
        rng = np.random.default_rng(3)
        client.register_vector("bench", rng.standard_normal(HIDDEN) * 0.01)
        client.upload_probe(Probe(name="bench",
                                  weights=rng.standard_normal(HIDDEN).astype(np.float32)
                                  / HIDDEN**0.5, site=ProbeSite(layer=MONITOR)))

        def load(bodies: list[dict[str, Any]], rate: float) -> dict[str, Any]:
            before = worker_host_time(url)
            result = asyncio.run(drive(url, bodies, rate))
            result["worker_host"] = host_time_delta(before, worker_host_time(url))
            return result

        yield load


def worker_host_time(url: str) -> dict[str, dict[str, float]]:
    """Per dynsteer worker hook: ``sum`` (s), ``count`` and the cumulative bucket counts by
    upper bound (``le``, s) of its histogram on the server's ``/metrics``, and ``cpu`` (s: the
    thread's CPU time inside the hook)."""
    import re
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, dict[str, float]] = {}
    name = "dynsteer_worker_host_seconds"
    for hook, le, value in re.findall(rf'^{name}_bucket{{hook="(\w+)",le="([^"]+)"}} (\S+)$',
                                      text, re.MULTILINE):
        found.setdefault(hook, {})[le] = float(value)
    for kind in ("sum", "count"):
        for hook, value in re.findall(rf'^{name}_{kind}{{hook="(\w+)"}} (\S+)$', text,
                                      re.MULTILINE):
            found.setdefault(hook, {})[kind] = float(value)
    for hook, value in re.findall(r'^dynsteer_worker_host_cpu_seconds_total{hook="(\w+)"} (\S+)$',
                                  text, re.MULTILINE):
        found.setdefault(hook, {})["cpu"] = float(value)
    for where, value in re.findall(r'^dynsteer_index_fills_total{on="(\w+)"} (\S+)$', text,
                                   re.MULTILINE):  # steps filled there, as a pseudo hook
        found.setdefault(f"fill_{where}", {})["count"] = float(value)
    return found


def host_time_delta(before: dict[str, dict[str, float]],
                    after: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per hook over the load: calls, mean µs per call (wall, and the thread's CPU time), the
    bound (µs) 99% of calls stayed within and the bound of the slowest call (None: above the
    last bound)."""
    out: dict[str, dict[str, float | None]] = {}
    for hook, values in after.items():
        old = before.get(hook, {})
        delta = {k: v - old.get(k, 0.0) for k, v in values.items()}
        calls = delta.get("count", 0.0)
        bounds = sorted((float(k), v) for k, v in delta.items()
                        if k not in ("sum", "count", "cpu"))

        def within(share: float, bounds: list[tuple[float, float]] = bounds,
                   calls: float = calls) -> float | None:
            bound = next(b for b, n in bounds if n >= share * calls)
            return None if bound == float("inf") else bound * 1e6

        out[hook] = {"calls": calls, "mean_us": delta.get("sum", 0.0) / max(calls, 1.0) * 1e6,
                     "mean_cpu_us": delta.get("cpu", 0.0) / max(calls, 1.0) * 1e6,
                     "p99_le_us": within(0.99) if calls and bounds else None,
                     "max_le_us": within(1.0) if calls and bounds else None}
    return out


PLAIN = ("vllm", "vllm-b")
"""Plain vLLM servers: ``vllm`` is every ratio's base; ``vllm-b`` is a second one, started where
``--runs`` puts it. With ``--runs vllm,dynsteer,vllm-b`` the dynsteer server starts between two
plain ones: ``vllm-b``'s ratio is the start order's own effect in that call, and ``bracketed``
compares dynsteer with both plain servers' latencies pooled (on some machines the server started
first read ~4-6% worse at ITL p99, whichever it was)."""
RUNS = (*PLAIN, "dynsteer", "dynsteer-plain", "dynsteer-static", "dynsteer-gated")
"""Plain vLLM (:data:`PLAIN`); dynsteer serving the mixed stream; dynsteer serving plain
vLLM's (unsteered) stream, which tells the enabled plugin's own cost from the steered
traffic's; dynsteer serving half plain, half static (or gated) requests, which tells the kinds'
costs apart. A dynsteer run named with the suffix ``-variant`` is that run on a server with the
engine options of ``--variant``."""
VARIANT = "-variant"
RUN_NAMES = (*PLAIN, *(name + suffix for name in RUNS if name not in PLAIN
                       for suffix in ("", VARIANT)))
"""Every name ``--runs`` takes: :data:`RUNS`, the dynsteer ones also with :data:`VARIANT`."""


CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
"""A ``taskset -c`` list: CPUs and ranges, comma-separated."""


def check_pins(ap: argparse.ArgumentParser, pins: list[str], servers: int) -> None:
    """``--pin-cpus``: one CPU list per server, each CPU on this machine."""
    if len(pins) != servers:
        ap.error(f"--pin-cpus: {len(pins)} CPU lists for {servers} servers; give one each")
    for pin in pins:
        if not CPU_LIST.fullmatch(pin):
            ap.error(f"--pin-cpus: {pin!r} is not a taskset -c list (e.g. 2-4 or 2,5)")
        top = max(int(n) for n in re.split(r"[,-]", pin))
        if top >= (os.cpu_count() or 1):
            ap.error(f"--pin-cpus: CPU {top} in {pin!r}; this machine has CPUs "
                     f"0-{(os.cpu_count() or 1) - 1}")


@exits_on_sigterm
def main() -> None:
    begun = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=16.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--mem", type=float, default=0.85)
    ap.add_argument("--runs", default="vllm,dynsteer",
                    help=f"servers in the order to run them, from {', '.join(RUNS)}; one "
                         "order and its reverse tell the order's effect from the plugin's")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the --runs order this many times (servers restarted each time); "
                         "pooled latencies and the run-to-run spread of the ratios")
    ap.add_argument("--interleave", type=int, default=0, metavar="SEGMENTS",
                    help="every server of --runs up at once (share --mem between them), the "
                         "stream cut into SEGMENTS parts that each server serves in turn, "
                         "the order reversed every other segment: servers compared at the "
                         "same time on the same host, since a server's host speed differs "
                         "from start to start by more than the plugin's cost")
    ap.add_argument("--variant", type=json.loads, default={},
                    help="dynsteer engine options (JSON) of the runs named NAME-variant, "
                         "e.g. '{\"fused_norms\": false}' for --runs vllm,dynsteer,"
                         "dynsteer-variant: an option against the default in one call")
    ap.add_argument("--warmup", type=int, default=0, metavar="REQUESTS",
                    help="with --interleave: before the measured segments, each server serves "
                         "this many requests of another stream (same mix and rate, other "
                         "prompts and vectors), reported apart as 'warmup' (the first ~20 s "
                         "of load after a start ran slower admitting steps)")
    ap.add_argument("--deadline", type=float, default=0.0, metavar="SECONDS",
                    help="with --interleave: begin no segment that, as long as the last one, "
                         "would end past SECONDS after this script started; the segments "
                         "measured are reported as usual (a fresh machine's first server "
                         "start, with its compile, took up to 260 s)")
    ap.add_argument("--pin-cpus", nargs="+", metavar="CPUS",
                    help="one taskset -c list per server of --runs (in its order, each server "
                         "once), e.g. 2-4 5-7 8-10: each server with its engine core on CPUs "
                         "of its own, so placement is the same for all (run this script "
                         "itself under taskset on other CPUs)")
    args = ap.parse_args()
    order = args.runs.split(",")
    if args.pin_cpus is not None:
        check_pins(ap, args.pin_cpus, len(dict.fromkeys(order)))
    if "vllm" not in order or not set(order) <= set(RUN_NAMES):
        ap.error(f"--runs: a comma list from {', '.join(RUNS)} (dynsteer ones optionally "
                 f"with {VARIANT}) with vllm in it")
    if args.deadline and not args.interleave:
        ap.error("--deadline needs --interleave (it stops between segments)")
    if args.warmup and not args.interleave:
        ap.error("--warmup needs --interleave (one start for every server's segments)")
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.tokenizer)
    pins = dict(zip(dict.fromkeys(order), args.pin_cpus or (), strict=False))

    def launch(name: str) -> Launch:
        return Launch(args.mem, pins.get(name))

    servers = {
        name: functools.partial(plain_server, model, args.out, name, launch(name))
        if name in PLAIN else functools.partial(
            dynsteer_server, model, args.out, name, launch(name),
            args.variant if name.endswith(VARIANT) else {})
        for name in RUN_NAMES}

    def stream_of(name: str, n: int = args.requests, seed: int = 0) -> list[dict[str, Any]]:
        """Server ``name``'s stream: plain vLLM's, or the mix its run name says."""
        return requests(n, "plain" if name in PLAIN else
                        name.removesuffix(VARIANT).partition("-")[2] or "mixed", seed)

    stream = {name: stream_of(name) for name in servers}
    results: dict[str, Any] = {"runs": [], "interleave": args.interleave, "pin_cpus": pins}
    done: dict[str, list[dict[str, Any]]] = {}
    raw: dict[str, np.ndarray] = {}

    def keep(name: str, run: dict[str, Any]) -> None:
        """A run kept as it ends (a call cut short keeps the runs before)."""
        run_done = run.pop("_done")
        done.setdefault(name, []).extend(run_done)
        results["runs"].append({"name": name, **run})
        (args.out / "serving.json").write_text(json.dumps(results, indent=2))
        at = f"{len(results['runs']) - 1}_{name}"
        raw[f"{at}_ttft_s"] = np.array([r["ttft"] for r in run_done])
        raw[f"{at}_itl_s"] = np.concatenate([r["itl"] for r in run_done])
        # Every chunk's arrival, to line the steps up across requests (which kind of
        # admission made a slow step); request i's chunks follow those of requests < i.
        raw[f"{at}_sent_s"] = np.array([r["sent"] for r in run_done])
        raw[f"{at}_chunks"] = np.array([len(r["stamps"]) for r in run_done])
        raw[f"{at}_stamps_s"] = np.concatenate([r["stamps"] for r in run_done])
        raw[f"{at}_kind"] = np.array([r["kind"] for r in run_done])
        np.savez_compressed(args.out / "latencies.npz", **raw)  # to pool runs of several calls
        print(f"{name} segment {run.get('segment', '-')}: TTFT p50 {run['ttft_ms_p50']:.1f} ms, "
              f"ITL p50 {run['itl_ms_p50']:.2f} / p99 {run['itl_ms_p99']:.2f} ms, admitting "
              f"step p50 {admit_text(run)}, {run['errors']} errors", flush=True)

    if args.interleave:  # every server up at once, the stream's segments turn about
        results["order"] = order
        with contextlib.ExitStack() as stack:
            loads = {name: stack.enter_context(servers[name]()) for name in order}
            size = -(-args.requests // args.interleave)
            if args.warmup:  # not pooled: its own table beside plain vLLM's
                results["warmup"] = warm_up(loads, order, stream_of, args.warmup, args.rate)
                (args.out / "serving.json").write_text(json.dumps(results, indent=2))
            last = 0.0  # the last segment's seconds
            for seg in range(args.interleave):
                if args.deadline and time.monotonic() - begun + last > args.deadline:
                    print(f"--deadline {args.deadline:.0f} s: {seg} of {args.interleave} "
                          "segments measured", flush=True)
                    break
                seg_start = time.monotonic()
                for name in order if seg % 2 == 0 else order[::-1]:
                    part = stream[name][seg * size:(seg + 1) * size]
                    keep(name, {"segment": seg, **loads[name](part, args.rate)})
                last = time.monotonic() - seg_start
    else:
        order = order * args.repeat
        results["order"] = order
        for name in order:  # one server at a time, restarted each run
            with servers[name]() as load:
                keep(name, load(stream[name], args.rate))
    report(results, done)
    (args.out / "serving.json").write_text(json.dumps(results, indent=2))


def admit_text(run: dict[str, Any]) -> str:
    """A load's admitting step (:func:`serving_steps.admitting_step_ms`) as printed."""
    ms = run.get(ADMIT)
    return "-" if ms is None else f"{ms:.2f} ms"


WARMUP_SEED = 1
"""The warm-up stream's prompts and vectors (the measured stream's are seed 0)."""


def warm_up(loads: dict[str, Load], order: list[str], stream_of: Callable[..., list[Any]],
            n: int, rate: float) -> dict[str, Any]:
    """``--warmup``: each server in turn serves ``n`` requests of the warm-up stream; its
    latencies, and each dynsteer server's against plain vLLM's (``ratios``)."""
    keys = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    runs = {}
    for name in order:
        run = loads[name](stream_of(name, n, WARMUP_SEED), rate)
        run.pop("_done")
        runs[name] = run
        print(f"{name} warm-up: TTFT p50 {run['ttft_ms_p50']:.1f} ms, ITL p50 "
              f"{run['itl_ms_p50']:.2f} / p99 {run['itl_ms_p99']:.2f} ms, admitting step p50 "
              f"{admit_text(run)}, {run['errors']} errors", flush=True)
    ratios = {name: {k: run[k] / runs["vllm"][k] for k in keys}
              for name, run in runs.items() if name != "vllm"}
    for name, ratio in ratios.items():
        print(f"{name} / vllm, warm-up:", {k: round(v, 4) for k, v in ratio.items()})
    return {"requests": n, "runs": runs, "ratios": ratios}


def report(results: dict[str, Any], done: dict[str, list[dict[str, Any]]]) -> None:
    """Print each run, then each server's latencies pooled over its runs against plain
    vLLM's (``results["pooled"]``, ``results["ratios"]``) and the spread of the ratio over
    the repetitions (the i-th run of a server against vLLM's i-th, ``results["pair_ratios"]``):
    a difference inside that spread is the servers' start-to-start variation, not the plugin."""
    keys = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "requests_per_s")
    print(f"{'server':<15} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'req/s':>7} {'errors':>6}")
    for r in results["runs"]:
        print(f"{r['name']:<15} {r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>9.1f} "
              f"{r['itl_ms_p50']:>8.2f} {r['itl_ms_p99']:>8.2f} {r['requests_per_s']:>7.2f} "
              f"{r['errors']:>6}")
    results["pooled"] = {name: latencies(d) for name, d in done.items()}
    results["ratios"], results["pair_ratios"] = {}, {}
    base = results["pooled"]["vllm"]
    mine = {name: [r for r in results["runs"] if r["name"] == name] for name in done}
    for name in done:
        if name == "vllm":
            continue
        ours = results["pooled"][name]
        results["ratios"][name] = {k: ours[k] / base[k] for k in keys if k in ours}
        results["pair_ratios"][name] = {
            k: [a[k] / b[k] for a, b in zip(mine[name], mine["vllm"], strict=False)]
            for k in keys}
        admits = [(a.get(ADMIT), b.get(ADMIT))
                  for a, b in zip(mine[name], mine["vllm"], strict=False)]
        if admits and all(a is not None and b is not None for a, b in admits):
            # Each load's stamps run on its own clock: the loads' medians, not one pooled.
            results["pair_ratios"][name][ADMIT] = [a / b for a, b in admits]
            results["ratios"][name][ADMIT] = (float(np.mean([a for a, _ in admits]))
                                              / float(np.mean([b for _, b in admits])))
        print(f"{name} / vllm, pooled:",
              {k: round(v, 4) for k, v in results["ratios"][name].items()})
        print(f"{name} / vllm, run by run:",
              {k: [round(v, 4) for v in vs] for k, vs in results["pair_ratios"][name].items()})
        if "vllm-b" in done and name not in PLAIN:
            both = latencies(done["vllm"] + done["vllm-b"])
            results.setdefault("bracketed", {})[name] = {k: ours[k] / both[k] for k in both}
            print(f"{name} / both plain servers, pooled:",
                  {k: round(v, 4) for k, v in results["bracketed"][name].items()})
        for r in mine[name]:
            for hook, h in r.get("worker_host", {}).items():
                print(f"{name}, worker hook {hook}: {h['calls']:.0f} calls, mean "
                      f"{h['mean_us']:.1f} µs (CPU {h['mean_cpu_us']:.1f}), 99% within "
                      f"{h['p99_le_us']} µs, all within {h['max_le_us']} µs")
            for kind, k in r.get("by_kind", {}).items():
                print(f"{name}, {kind} requests: TTFT p50 {k['ttft_ms_p50']:.1f} ms, "
                      f"ITL p50 {k['itl_ms_p50']:.2f} / p99 {k['itl_ms_p99']:.2f} ms")


if __name__ == "__main__":
    main()
