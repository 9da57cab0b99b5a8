"""Serving latency over HTTP: `dynsteer serve` vs plain vLLM on the same request stream (GPU).

One server at a time on the same Llama-8B-shaped dummy model (vocabulary and tokenizer of the
embedded SmolLM2, so the server can detokenize), then the same stream of streaming
``/v1/completions`` requests at a fixed arrival rate: 128 random prompt tokens, 128 generated
(``ignore_eos``). The dynsteer server gets a mix: 50% plain, 25% static (32 distinct inline
vectors, base64), 25% gated (a registered probe at layer 16 gating a registered vector at
layers 16-23); plain vLLM gets the same requests without the ``dynsteer`` field. Reported per
server: time to first token and inter-token latency (p50 / p99, ms), and completed requests
per second. Prints a table and writes ``serving.json``.

Usage: python benchmarks/serving.py --out DIR --tokenizer DIR [--rate 16] [--requests 400]
       [--dynsteer-first]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import GATED_LAYERS, HIDDEN, LLAMA_8B, MONITOR

from dynsteer.controller.contract import encode_f32
from dynsteer.controller.launch import ServerProcess, free_port

PROMPT_LEN, GEN_LEN = 128, 128
VOCAB = 49152
KEY = "bench-key"


def make_model(folder: Path, tokenizer: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "vocab_size": VOCAB}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder / name)
    return folder


def requests(n: int, steered: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((32, HIDDEN)).astype(np.float32) * 0.01
    gate = {"probe": "bench", "layer": MONITOR,
            "steer": [{"vector": "bench", "layers": GATED_LAYERS}]}
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": "bench", "prompt": rng.integers(100, VOCAB - 100, PROMPT_LEN).tolist(),
            "max_tokens": GEN_LEN, "temperature": 0.0, "ignore_eos": True, "stream": True}
        kind = ("plain", "plain", "static", "gated")[i % 4]
        if steered and kind == "static":
            body["dynsteer"] = {"steer": [{"vector_b64": encode_f32(vectors[i % 32]),
                                           "layers": [MONITOR]}]}
        elif steered and kind == "gated":
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
    return {"ttft": stamps[0] - t0, "itl": np.diff(stamps).tolist(), "end": stamps[-1]}


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
    return {"requests": len(bodies), "errors": len(errors), "first_errors": errors[:3],
            **latencies(done), "requests_per_s": len(done) / span, "by_kind": by_kind}


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


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 480.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError("server did not start")


def serve_args(model: Path, mem: float) -> list[str]:
    return [str(model), "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", str(PROMPT_LEN + GEN_LEN + 16), "--max-num-seqs", "256",
            "--gpu-memory-utilization", str(mem), "--served-model-name", "bench",
            "--seed", "0"]


@contextlib.contextmanager
def plain_vllm(args: list[str], log: Path, env: dict[str, str] | None = None,
               timeout: float = 480.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Plain vLLM's OpenAI server (``--model ARGS``) on a free loopback port, its log in
    ``log``: yields (its URL, the process) once ``/health`` answers; stopped on exit. ``env``
    is added to this process's environment (e.g. ``VLLM_PLUGINS=""``: no plugin at all)."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", *args, "--port", str(port),
                                 "--host", "127.0.0.1"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_health(url, proc, timeout)
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def run_plain(model: Path, log: Path, bodies: list[dict[str, Any]], rate: float,
              mem: float) -> dict[str, Any]:
    with plain_vllm(serve_args(model, mem), log) as (url, _):
        return asyncio.run(drive(url, bodies, rate))


def run_dynsteer(model: Path, log: Path, bodies: list[dict[str, Any]], rate: float,
                 mem: float) -> dict[str, Any]:
    from dynsteer.controller.client import DynsteerClient
    from dynsteer.probes import Probe, ProbeSite

    server = ServerProcess([*serve_args(model, mem), "--dynsteer-api-key", KEY], log)
    try:
        server.wait_ready(timeout=480)
        client = DynsteerClient(server.url, api_key=KEY)
        rng = np.random.default_rng(3)
        client.register_vector("bench", rng.standard_normal(HIDDEN) * 0.01)
        client.upload_probe(Probe(name="bench",
                                  weights=rng.standard_normal(HIDDEN).astype(np.float32)
                                  / HIDDEN**0.5, site=ProbeSite(layer=MONITOR)))
        return asyncio.run(drive(server.url, bodies, rate))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=16.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--mem", type=float, default=0.85)
    ap.add_argument("--dynsteer-first", action="store_true",
                    help="serve with dynsteer first (default: plain vLLM first); one pair of "
                         "runs each way tells the order's effect from the plugin's")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "llama8b", args.tokenizer)
        runs = {
            "vllm": lambda: run_plain(model, args.out / "serve_vllm.log",
                                      requests(args.requests, steered=False), args.rate,
                                      args.mem),
            "dynsteer": lambda: run_dynsteer(model, args.out / "serve_dynsteer.log",
                                             requests(args.requests, steered=True), args.rate,
                                             args.mem),
        }
        order = ["dynsteer", "vllm"] if args.dynsteer_first else ["vllm", "dynsteer"]
        done = {name: runs[name]() for name in order}
        results: dict[str, Any] = {"vllm": done["vllm"], "dynsteer": done["dynsteer"],
                                   "order": order}
    print(f"{'server':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'req/s':>7} {'errors':>6}")
    for name in ("vllm", "dynsteer"):
        r = results[name]
        print(f"{name:<10} {r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>9.1f} "
              f"{r['itl_ms_p50']:>8.2f} {r['itl_ms_p99']:>8.2f} {r['requests_per_s']:>7.2f} "
              f"{r['errors']:>6}")
    base, ours = results["vllm"], results["dynsteer"]
    results["ratios"] = {k: ours[k] / base[k] for k in
                         ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                          "requests_per_s")}
    print("dynsteer / vllm:", {k: round(v, 4) for k, v in results["ratios"].items()})
    for kind, r in ours["by_kind"].items():
        print(f"dynsteer, {kind} requests: TTFT p50 {r['ttft_ms_p50']:.1f} ms, "
              f"ITL p50 {r['itl_ms_p50']:.2f} / p99 {r['itl_ms_p99']:.2f} ms")
    (args.out / "serving.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
