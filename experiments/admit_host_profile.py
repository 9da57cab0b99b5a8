"""Host time of an engine step that admits a request: stock vLLM against the plugin (CPU).

Question: on the GPU, serving steps that admit a request (a 128-token prefill beside ~10
decodes) ran ~1-1.5 ms longer on the dynsteer server than on plain vLLM, decode steps were equal,
and the timed worker hooks explain only ~0.3 ms. What else does the plugin add on the host?

What it does: real engines, one at a time, each in a fresh subprocess, in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a tiny random Llama (``--hidden`` 512, ``--layers``
32, vLLM's default compile mode; the model's compute is not what is measured: it is taken out,
below). ``LLMEngine.step()`` is driven by hand:
a request (128 random prompt tokens, ``--gen`` greedy tokens, ignore_eos) is added before every
``--every``-th step, so ~``gen/every`` requests decode while each new one is admitted. Engines:

* ``stock``: ``DYNSTEER_DISABLE=1`` (no patch installed), plain requests (a);
* ``plugin``: ``additional_config={"dynsteer": {}}`` (default sites ``post_block@*``, monitors at
  25/50/75%), a registered vector ``bench`` and probe ``bench``; segments alternate the
  ``plain`` stream (b) and the ``mixed`` stream (c: i%4 = plain, plain, static = a base64 vector
  at layer 16 out of 32 distinct ones, gated = probe ``bench`` at layer 16 gating ``bench`` at
  layers 16-23; specs as JSON text in ``extra_args["dynsteer"]``, as the server's middleware
  hands them on).

Per step it records the wall time of the engine core's step (``EngineCore.step_fn``) and of its
parts, by wrapping instance attributes after the engine is built (so dynsteer's own wrappers are
inside them): ``schedule``, ``update_from_output``, the runner's ``_update_states`` /
``_prepare_inputs`` / ``_model_forward`` / ``sample_tokens``, and Python GC pauses. *Host time*
= engine-core step - ``_model_forward`` (the forward's compute, which on CPU dominates and on the
GPU is graphs). Per admission it times the frontend (``InputProcessor.process_inputs``, the API
server's process in serving), ``EngineCore.preprocess_add_request`` (the engine core's input
thread in serving) and ``EngineCore.add_request``. Steps are classed by whether the scheduler
admitted a new request in them. Timed segments and cProfile segments are separate (cProfile's
overhead would inflate the timings); the profiler is off inside ``_model_forward``, so its
tables are host-only. The plugin child also times msgpack encode/decode of one
``EngineCoreRequest`` per kind (frontend -> engine core in serving).

Rounds alternate the engine order (stock first in even rounds); the report gives, per round,
the median host µs per admitting and per decode step per config, the differences (c)-(a) and
(b)-(a) with their spread over rounds, the phase breakdown, and the functions whose µs per step
grew most, plus every dynsteer function (files under this repository).

Usage (~3.5 min a round on 2 cores; 4 rounds took 14 min):
    .venv/bin/python experiments/admit_host_profile.py --out /tmp/ahp [--rounds 3]
        [--hidden 512] [--layers 32] [--gen 40] [--every 4] [--admissions 48]
Writes ``OUT/round*_*.json`` (each child's raw data) and ``OUT/report.json``; prints the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPT = 128
MONITOR = 16
GATED_LAYERS = list(range(16, 24))
KINDS = {"plain": ("plain",), "mixed": ("plain", "plain", "static", "gated")}


# ---- the model ---------------------------------------------------------------------------
def make_model(path: Path, hidden: int, layers: int, vocab: int = 512) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.config.torch_dtype = "float32"
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


# ---- the child: one engine ---------------------------------------------------------------
class Recorder:
    """Wall time of named calls within the current step (perf_counter_ns)."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.depth_forward = False
        self.profiler: Any = None

    def wrap(self, obj: Any, name: str, label: str, forward: bool = False) -> None:
        fn = getattr(obj, name)
        cur = self
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            prof = cur.profiler
            if forward and prof is not None:
                prof.disable()
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cur.cur[label] = cur.cur.get(label, 0.0) + (clock() - t0) / 1e3
                if forward and prof is not None:
                    prof.enable()

        setattr(obj, name, timed)


def child(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.child == "stock":
        os.environ["DYNSTEER_DISABLE"] = "1"
    import cProfile
    import gc
    import pstats

    import numpy as np
    from vllm import LLM, SamplingParams

    from dynsteer.controller.contract import encode_f32

    plugin = args.child == "plugin"
    kw: dict[str, Any] = dict(
        dtype="float32", max_model_len=PROMPT + args.gen + 16, max_num_seqs=32,
        max_num_batched_tokens=1024, skip_tokenizer_init=True, seed=0,
        enable_prefix_caching=True)
    if plugin:
        kw["additional_config"] = {"dynsteer": {}}
    t_start = time.perf_counter()
    llm = LLM(str(args.model), **kw)
    startup = time.perf_counter() - t_start
    engine = llm.llm_engine
    client = engine.engine_core
    core = client.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    hidden = args.hidden
    rng = np.random.default_rng(3)
    if plugin:
        from dynsteer.engine_ext import Steering

        steering = Steering(llm)
        steering.register_vector("bench", rng.standard_normal(hidden) * 0.01)
        steering.register_probe("bench", weights=(rng.standard_normal(hidden)
                                                  / hidden**0.5).astype(np.float32))
    vectors = np.random.default_rng(0).standard_normal((32, hidden)).astype(np.float32) * 0.01
    gate = {"probe": "bench", "layer": MONITOR,
            "steer": [{"vector": "bench", "layers": GATED_LAYERS}]}

    def spec(kind: str, i: int) -> str | None:
        if kind == "static":
            return json.dumps({"steer": [{"vector_b64": encode_f32(vectors[i % 32]),
                                          "layers": [MONITOR]}]})
        if kind == "gated":
            return json.dumps({"gate": gate})
        return None

    rec = Recorder()
    rec.wrap(core.scheduler, "schedule", "schedule")
    rec.wrap(core.scheduler, "update_from_output", "update_from_output")
    rec.wrap(runner, "_update_states", "update_states")
    rec.wrap(runner, "_prepare_inputs", "prepare_inputs")
    rec.wrap(runner, "_model_forward", "forward", forward=True)
    rec.wrap(runner, "sample_tokens", "sample_tokens")
    rec.wrap(runner, "execute_model", "execute_model")
    rec.wrap(client, "add_request", "core_add_total")
    rec.wrap(core, "preprocess_add_request", "core_preprocess")
    rec.wrap(core, "add_request", "core_add")
    rec.wrap(engine.input_processor, "process_inputs", "frontend_process")
    sched_schedule = core.scheduler.schedule
    admitted_now = [0]

    def schedule(*a: Any, **k: Any) -> Any:
        out = sched_schedule(*a, **k)
        admitted_now[0] = len(out.scheduled_new_reqs)
        return out

    core.scheduler.schedule = schedule
    gc_t0 = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter_ns()
        else:
            rec.cur["gc"] = rec.cur.get("gc", 0.0) + (time.perf_counter_ns() - gc_t0[0]) / 1e3
            rec.cur[f"gc{info['generation']}_n"] = rec.cur.get(f"gc{info['generation']}_n", 0) + 1

    gc.callbacks.append(on_gc)
    prompt_rng = np.random.default_rng(args.seed)
    counter = [0]
    samples: dict[str, Any] = {}

    def segment(stream: str, profile: bool) -> dict[str, Any]:
        kinds = KINDS[stream]
        steps: list[dict[str, Any]] = []
        adds: list[dict[str, Any]] = []
        profs = {"admit": cProfile.Profile(), "decode": cProfile.Profile()} if profile else None
        admitted = 0
        i = 0
        while admitted < args.admissions or engine.has_unfinished_requests():
            added = None
            if admitted < args.admissions and i % args.every == 0:
                kind = kinds[admitted % len(kinds)]
                s = spec(kind, counter[0])
                counter[0] += 1
                params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True,
                                        detokenize=False,
                                        extra_args=None if s is None else {"dynsteer": s})
                prompt = prompt_rng.integers(3, 500, PROMPT).tolist()
                rec.cur = {}
                t0 = time.perf_counter_ns()
                engine.add_request(f"r{counter[0]}", {"prompt_token_ids": prompt}, params)
                row = {"kind": kind, "total": (time.perf_counter_ns() - t0) / 1e3, **rec.cur}
                adds.append(row)
                added = kind
                admitted += 1
            rec.cur = {}
            prof = None
            if profs is not None:
                prof = profs["admit" if added else "decode"]
                rec.profiler = prof
                prof.enable()
            t0 = time.perf_counter_ns()
            engine.step()
            t1 = time.perf_counter_ns()
            if prof is not None:
                prof.disable()
                rec.profiler = None
            row = {**rec.cur, "engine_step": (t1 - t0) / 1e3, "admitted": admitted_now[0],
                   "added": added, "running": len(core.scheduler.running), "i": i,
                   "n_admitted": admitted}
            steps.append(row)
            i += 1
        result: dict[str, Any] = {"stream": stream, "steps": steps, "adds": adds}
        if profs is not None:
            n_admit = sum(1 for s in steps if s["added"])
            n_decode = len(steps) - n_admit
            result["profile"] = {}
            for cls, p in profs.items():
                st = pstats.Stats(p)
                n = n_admit if cls == "admit" else n_decode
                rows = {}
                for (fname, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
                    rows[f"{fname}:{line}:{func}"] = [nc / n, tt * 1e6 / n, ct * 1e6 / n]
                result["profile"][cls] = {"steps": n, "funcs": rows}
        return result

    # engine-core step time: wrap step_fn (a bound method kept by the client)
    core_step = core.step_fn

    def timed_step() -> Any:
        t0 = time.perf_counter_ns()
        try:
            return core_step()
        finally:
            rec.cur["core_step"] = (time.perf_counter_ns() - t0) / 1e3

    core.step_fn = timed_step

    # capture one EngineCoreRequest per kind for the msgpack micro-benchmark
    orig_client_add = client.add_request

    def capture_add(request: Any) -> Any:
        kind = "plain"
        xa = request.sampling_params.extra_args if request.sampling_params else None
        if xa:
            kind = "gated" if "gate" in json.dumps(xa.get("dynsteer_wire", {}), default=str) \
                and (xa.get("dynsteer_wire") or {}).get("gate") else "static"
        samples.setdefault(kind, request)
        return orig_client_add(request)

    client.add_request = capture_add

    out: dict[str, Any] = {"config": args.child, "startup_s": startup, "segments": []}
    segment("mixed" if plugin else "plain", False)  # warm-up, unrecorded
    order = (["plain", "mixed", "mixed", "plain"] if plugin else ["plain", "plain"])
    for stream in order[: args.segments * (2 if plugin else 1)]:
        out["segments"].append(segment(stream, False))
    for stream in (["plain", "mixed"] if plugin else ["plain"]):
        out["segments"].append(segment(stream, True))

    # msgpack of an EngineCoreRequest per kind (API server -> engine core in serving)
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    ser = {}
    for kind, req in samples.items():
        bufs = enc.encode(req)
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            enc.encode(req)
        t1 = time.perf_counter()
        for _ in range(n):
            dec.decode(bufs)
        t2 = time.perf_counter()
        ser[kind] = {"bytes": sum(len(b) for b in bufs), "encode_us": (t1 - t0) / n * 1e6,
                     "decode_us": (t2 - t1) / n * 1e6}
    out["msgpack"] = ser
    if plugin:
        out["worker_host_time"] = steering.info()
    Path(args.json).write_text(json.dumps(out, default=str))
    client.engine_core.shutdown() if hasattr(client, "engine_core") else None


# ---- the parent: rounds and the report ----------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def host_us(s: dict[str, Any]) -> float:
    return s.get("core_step", 0.0) - s.get("forward", 0.0)


PHASES = ("core_step", "forward", "schedule", "execute_model", "update_states",
          "prepare_inputs", "sample_tokens", "update_from_output", "gc")


def summarize_child(data: dict[str, Any], skip: int) -> dict[str, Any]:
    """Per stream: medians per step class over the timed segments (steps after ``skip``
    admissions, while admissions continue: steady state)."""
    by: dict[str, dict[str, list[dict[str, Any]]]] = {}
    adds: dict[str, list[dict[str, Any]]] = {}
    for seg in data["segments"]:
        if "profile" in seg:
            continue
        last = max(s["n_admitted"] for s in seg["steps"])
        for s in seg["steps"]:
            if s["n_admitted"] <= skip or s["n_admitted"] >= last:  # warm-up, drain
                continue
            cls = "admit" if s["admitted"] else "decode"
            by.setdefault(seg["stream"], {}).setdefault(cls, []).append(s)
        for a in seg["adds"][skip:]:
            adds.setdefault(seg["stream"], []).append(a)
    out: dict[str, Any] = {}
    for stream, classes in by.items():
        out[stream] = {}
        for cls, steps in classes.items():
            row = {"n": len(steps), "host_us": med([host_us(s) for s in steps]),
                   "host_us_mean": statistics.fmean(host_us(s) for s in steps),
                   "running": med([s["running"] for s in steps])}
            for p in PHASES:
                row[p] = med([s.get(p, 0.0) for s in steps])
            row["gc_mean"] = statistics.fmean(s.get("gc", 0.0) for s in steps)
            out[stream][cls] = row
        kinds: dict[str, list[dict[str, Any]]] = {}
        for a in adds.get(stream, []):
            kinds.setdefault(a["kind"], []).append(a)
        out[stream]["add_request"] = {
            k: {p: med([a.get(p, 0.0) for a in v]) for p in
                ("total", "frontend_process", "core_preprocess", "core_add")}
            for k, v in kinds.items()}
    return out


def profiles(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {seg["stream"]: seg["profile"] for seg in data["segments"] if "profile" in seg}


def report(out: Path, rounds: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    rep: dict[str, Any] = {"rounds": []}
    diffs: dict[str, list[float]] = {}
    for r in rounds:
        s = summarize_child(r["stock"], skip)["plain"]
        p = summarize_child(r["plugin"], skip)
        row = {"a": s, "b": p["plain"], "c": p["mixed"]}
        rep["rounds"].append(row)
        for cls in ("admit", "decode"):
            for cfg in ("b", "c"):
                for p_ in ("host_us", "host_us_mean", *PHASES[2:]):
                    key = f"{cls}:{cfg}-a:{p_}"
                    diffs.setdefault(key, []).append(row[cfg][cls][p_] - s[cls][p_])
    rep["diffs"] = {k: {"median": med(v), "min": min(v), "max": max(v), "all": v}
                    for k, v in diffs.items()}
    # profiles: mean over rounds of per-step own/cum µs
    agg: dict[tuple[str, str], dict[str, list[list[float]]]] = {}
    for r in rounds:
        for cfg, stream, data in (("a", "plain", r["stock"]), ("b", "plain", r["plugin"]),
                                  ("c", "mixed", r["plugin"])):
            prof = profiles(data)[stream]
            for cls in ("admit", "decode"):
                for fn, v in prof[cls]["funcs"].items():
                    agg.setdefault((cfg, cls), {}).setdefault(fn, []).append(v)
    mean = {k: {fn: [statistics.fmean(x[i] for x in vs) for i in range(3)]
                for fn, vs in d.items()} for k, d in agg.items()}
    rep["profile_top"] = {}
    for cls in ("admit", "decode"):
        for cfg in ("b", "c"):
            base, cur = mean[("a", cls)], mean[(cfg, cls)]
            rows = []
            for fn in set(base) | set(cur):
                b = base.get(fn, [0, 0, 0])
                c = cur.get(fn, [0, 0, 0])
                rows.append({"fn": fn, "calls": c[0], "calls_a": b[0], "own_us": c[1],
                             "own_delta": c[1] - b[1], "cum_us": c[2], "cum_delta": c[2] - b[2],
                             "dynsteer": str(REPO) in fn})
            rep["profile_top"][f"{cls}:{cfg}"] = {
                "own_delta": sorted(rows, key=lambda x: -x["own_delta"])[:25],
                "cum_delta": sorted(rows, key=lambda x: -x["cum_delta"])[:40],
                "dynsteer_cum": sorted([x for x in rows if x["dynsteer"]],
                                       key=lambda x: -x["cum_us"])[:40],
                "own_total_us": sum(x["own_us"] for x in rows),
                "own_total_us_a": sum(base.get(fn, [0, 0, 0])[1] for fn in base)}
    rep["msgpack"] = [r["plugin"].get("msgpack") for r in rounds]
    rep["worker_host_time"] = rounds[-1]["plugin"].get("worker_host_time")
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    return rep


def print_report(rep: dict[str, Any]) -> None:
    print("\n== per round: median host µs per step (core step - forward), n steps")
    for i, r in enumerate(rep["rounds"]):
        for cls in ("admit", "decode"):
            print(f"round {i} {cls:6s} " + "  ".join(
                f"{cfg}={r[cfg][cls]['host_us']:8.0f} (n={r[cfg][cls]['n']}, run "
                f"{r[cfg][cls]['running']:.0f})" for cfg in "abc"))
    print("\n== differences to (a), median [min, max] over rounds, µs")
    for k, v in rep["diffs"].items():
        print(f"{k:40s} {v['median']:8.1f} [{v['min']:8.1f}, {v['max']:8.1f}]")
    print("\n== add_request per kind (last round, plugin mixed / stock plain), µs")
    print(json.dumps({"c": rep["rounds"][-1]["c"]["add_request"],
                      "a": rep["rounds"][-1]["a"]["add_request"]}, indent=1))
    for key, t in rep["profile_top"].items():
        print(f"\n== profile {key}: own total {t['own_total_us']:.0f} µs/step "
              f"(a: {t['own_total_us_a']:.0f})")
        print("-- cum delta vs a (µs/step)")
        for x in t["cum_delta"][:25]:
            print(f"{x['cum_delta']:9.1f} {x['cum_us']:9.1f} calls {x['calls']:7.1f} "
                  f"(a {x['calls_a']:7.1f})  {x['fn'].replace(str(REPO), '.')[-110:]}")
        print("-- own delta vs a")
        for x in t["own_delta"][:15]:
            print(f"{x['own_delta']:9.1f} {x['own_us']:9.1f} calls {x['calls']:7.1f} "
                  f"(a {x['calls_a']:7.1f})  {x['fn'].replace(str(REPO), '.')[-110:]}")
    print("\n== msgpack", json.dumps(rep["msgpack"][-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/admit_host_profile"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--gen", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--admissions", type=int, default=40)
    ap.add_argument("--segments", type=int, default=2,
                    help="timed segments per stream per engine")
    ap.add_argument("--skip", type=int, default=10, help="admissions before steady state")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--child", choices=["stock", "plugin"])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        model = make_model(args.out / f"llama-h{args.hidden}-l{args.layers}", args.hidden,
                           args.layers)
        for r in range(args.rounds):
            order = ("stock", "plugin") if r % 2 == 0 else ("plugin", "stock")
            for cfg in order:
                path = args.out / f"round{r}_{cfg}.json"
                cmd = [sys.executable, __file__, "--child", cfg, "--model", str(model),
                       "--json", str(path), "--hidden", str(args.hidden), "--gen",
                       str(args.gen), "--every", str(args.every), "--admissions",
                       str(args.admissions), "--segments", str(args.segments),
                       "--seed", str(r)]
                t0 = time.time()
                with open(args.out / f"round{r}_{cfg}.log", "w") as log:
                    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=REPO)
                print(f"round {r} {cfg}: {time.time() - t0:.0f} s", flush=True)
    rounds = []
    r = 0
    while (args.out / f"round{r}_stock.json").exists() and \
            (args.out / f"round{r}_plugin.json").exists():
        rounds.append({cfg: json.loads((args.out / f"round{r}_{cfg}.json").read_text())
                       for cfg in ("stock", "plugin")})
        r += 1
    print_report(report(args.out, rounds, args.skip))


if __name__ == "__main__":
    main()
