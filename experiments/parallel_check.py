"""Steering under tensor and pipeline parallelism equals one rank (issue 18), on any build.

One tiny random Llama (fp32), the same requests on each layout, every layout in its own
process (a second engine in one process does not start reliably on GPUs): static steering at
every hook and phase, gated steering (probe on the first PP stage, gated sites on both), the
built-in ``latch`` and ``proportional`` controllers, global steering set then cleared, and
activation capture at a site of each stage, and the prefix guard (prefix caching on: a
follow-up of a request gated in decode hits exactly the blocks before the first position the
gate steered, so the report of the rank that computes the gate reaches the scheduler).
Compared with the one-rank run: greedy tokens equal, logprobs within ``--atol``, capture within
2e-4, the cleared run equal to the unsteered one, the same prefix hits, and every rank's
controller checksum and folded step count equal.

On GPUs each layout starts with the TP settings of the README's GPU section (the host keeps
NVLink multicast off: no IPC / symmetric-memory all-reduce, no all-reduce fusions); on the CPU
build one core per rank.

Usage: python -u experiments/parallel_check.py OUT [--layouts tp2,pp2] [--atol 2e-3]
       (writes parallel_<layout>.json per layout and parallel_check.json; exits 1 on a failure)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "benchmarks"))

from tp_settings import GPU_TP_ENV, GPU_TP_KWARGS  # noqa: E402

LAYOUTS: dict[str, dict[str, int]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
GPU_KWARGS: dict[str, Any] = {"gpu_memory_utilization": 0.3, **GPU_TP_KWARGS}
CAPTURE_SITES = "post_block@1,post_block@3"
"""Default monitor sites of the 4-layer model, one on each PP stage."""
GUARD_BLOCK = 32
"""The engines' KV block size (prefix caching on), for the prefix-guard check."""
GUARD_PROMPT = [1, *range(300, 369)]
"""70 tokens: two full blocks of prompt; decode tokens fill the third block and beyond."""
GUARD_DECODE = 40
MONITOR_SITES = "pre_attn@0,post_block@1,post_block@3"
"""The guard's gate reads ``pre_attn@0`` (the token embedding); the others' gates and the
capture read the default monitor sites."""


def gate_spec() -> dict[str, Any]:
    """The probe at layer 1 (the first PP stage) gating a vector at layers 1 and 3 (both)."""
    from tiny_models import vec

    return {"probe": {"weights": vec(1, norm=1.0), "threshold": 0.0, "sharpness": 50.0},
            "layer": 1, "steer": [{"vector": vec(31), "layers": [1, 3]}]}


def requests() -> tuple[list[list[int]], list[Any]]:
    """The prompts and specs every layout runs (tiny_models' shapes and vectors)."""
    from tiny_models import STATIC_CASES

    gate = {**gate_spec(), "trace": True}
    specs = [None, *({"steer": e} for e in STATIC_CASES.values()), {"gate": gate},
             {"gate": gate, "controller": {"name": "latch", "k": 2}},
             {"gate": gate, "controller": {"name": "proportional", "gain": 3.0}}]
    prompts = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 9, 8, 7]]
    return [prompts[i % 2] for i in range(len(specs))], specs


def untraced(specs: list[Any]) -> list[Any]:
    """The static and gated specs again, without traces and controllers: the steps that run
    only these are the ones vLLM's V2 runner on CUDA fills on the device (a traced gate or a
    controller needs the host fill)."""
    return [s if s is None or "gate" not in s else {"gate": {**s["gate"], "trace": False}}
            for s in specs if s is None or "controller" not in s]


def guard_run(llm: Any, steering: Any, model: str) -> dict[str, Any]:
    """The prefix guard under one layout (as ``tests/test_prefix_cache.py`` checks it on one
    rank). A gate whose probe is the embedding of a token the model first generates at decode
    position ``pos`` (read at ``pre_attn@0``) steers layers 1 and 3 from ``pos`` on; a follow-up
    whose prompt is that request's prompt + output, with the same gate, may hit only the blocks
    before the one holding ``pos``: the rank that computes the gate reports it to the
    scheduler."""
    import numpy as np
    from engine_utils import params, run
    from safetensors.numpy import load_file

    def one(tokens: list[int], spec: Any, max_tokens: int) -> Any:
        return run(llm, [tokens], [params(max_tokens, spec=spec, prompt_logprobs=None)])[0]

    plain = one(GUARD_PROMPT, None, GUARD_DECODE)
    tokens = GUARD_PROMPT + list(plain.outputs[0].token_ids)
    fresh = [t for t in range(len(GUARD_PROMPT), len(tokens) - 1)
             if tokens[t] not in tokens[:t]]
    pos = next((t for t in fresh if 2 * GUARD_BLOCK <= t < 3 * GUARD_BLOCK), fresh[0])
    embeds = load_file(str(Path(model) / "model.safetensors"))["model.embed_tokens.weight"]
    probe = embeds[tokens[pos]].astype(np.float64)
    norm2 = float(probe @ probe)
    spec = {"gate": {"probe": {"weights": probe.tolist(), "threshold": norm2 / 2,
                               "sharpness": 50.0 / norm2},
                     "layer": 0, "hook": "pre_attn", "trace": True,
                     "steer": gate_spec()["steer"]}}
    first = one(GUARD_PROMPT, spec, GUARD_DECODE)
    generated = list(first.outputs[0].token_ids)
    warm = one(GUARD_PROMPT + generated, spec, 4)
    return {"pos": pos, "generated": generated, "gates": steering.telemetry(first)["gates"],
            "warm_cached": warm.num_cached_tokens,
            "blocks_withheld": steering.cache_stats()["blocks_withheld"]}


def guard_checks(guard: dict[str, Any], one: dict[str, Any] | None) -> dict[str, bool]:
    """The gate first fired at ``pos`` and the follow-up hit exactly the blocks before it
    (and, beside a one-rank run, the same position, decode and hits as there)."""
    from dynsteer.engine_ext.prefix_guard.guard import DYNAMIC_EPSILON

    pos, gates = guard["pos"], guard["gates"]
    checks = {
        "prefix guard: gate first fires at the chosen position": gates[pos] > 0.5 and all(
            g is None or g < DYNAMIC_EPSILON for g in gates[:pos]),
        "prefix guard: follow-up hits only blocks before the first dynamic position":
            guard["warm_cached"] == pos // GUARD_BLOCK * GUARD_BLOCK,
        "prefix guard: blocks were withheld": guard["blocks_withheld"] > 0,
    }
    if one is not None:
        checks["prefix guard: same position, decode and hits as one rank"] = (
            (pos, guard["generated"], guard["warm_cached"])
            == (one["pos"], one["generated"], one["warm_cached"]))
    return checks


def run_layout(layout: str, model: str, out: Path) -> None:
    """One layout's outputs, written as JSON (the child process)."""
    import torch
    from engine_utils import ALL_SITES, logprobs_of, params, run, start_llm, stop_llm
    from tiny_models import vec

    from dynsteer.engine_ext import Steering

    extra: dict[str, Any] = dict(LAYOUTS[layout])
    if torch.cuda.is_available():
        extra.update(GPU_KWARGS)
    prompts, specs = requests()
    started = time.monotonic()
    llm = start_llm(model, dynsteer={"sites": ALL_SITES, "monitor_sites": MONITOR_SITES},
                    enable_prefix_caching=True, block_size=GUARD_BLOCK, **extra)
    ready = time.monotonic() - started
    try:
        steering = Steering(llm)
        outs = run(llm, prompts, [params(8, spec=s) for s in specs])
        fills_before = [rank["index_fills"] for rank in steering.info()]
        plain_specs = untraced(specs)
        plain_outs = run(llm, prompts[:len(plain_specs)],
                         [params(8, spec=s) for s in plain_specs])
        fills = [{k: rank["index_fills"][k] - before.get(k, 0) for k in rank["index_fills"]}
                 for rank, before in zip(steering.info(), fills_before, strict=True)]
        per_rank = [llm.collective_rpc("dynsteer_telemetry", args=(o.request_id,))
                    for o, s in zip(outs, specs, strict=True) if s and "gate" in s]
        steering.set_global([{"vector": vec(41), "layers": [0, 3]}])
        (under_global,) = run(llm, prompts[:1], [params(8)])
        steering.clear_global()
        (cleared,) = run(llm, prompts[:1], [params(8)])
        capture = steering.capture(prompts[1:3], CAPTURE_SITES, reduce="all")
        guard = guard_run(llm, steering, model)
        info = steering.info()
    finally:
        stop_llm(llm)

    def tokens_and_logprobs(o: Any) -> dict[str, Any]:
        tokens, lps = logprobs_of(o)
        return {"tokens": tokens, "logprobs": lps.tolist()}

    out.write_text(json.dumps({
        "layout": layout, "ready_s": ready,
        "outputs": [tokens_and_logprobs(o) for o in outs],
        "untraced_outputs": [tokens_and_logprobs(o) for o in plain_outs],
        "untraced_index_fills": fills, "cuda": torch.cuda.is_available(),
        "global": tokens_and_logprobs(under_global), "cleared": tokens_and_logprobs(cleared),
        "capture": {site: [a.tolist() for a in arrays] for site, arrays in capture.items()},
        "guard": guard,
        "per_rank_telemetry": [[{k: t[k] for k in ("gates", "scores", "controller")}
                                for t in ranks] for ranks in per_rank],
        "ranks": [{k: rank[k] for k in ("controller_checksum", "controller_checked_steps",
                                        "controller_checksum_log", "rows_rejected")}
                  for rank in info],
    }))


def compare(one: dict[str, Any], other: dict[str, Any], atol: float) -> dict[str, Any]:
    """The checks of one layout against the one-rank run."""
    import numpy as np

    def same(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
        err = float(np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"])).max())
        return a["tokens"] == b["tokens"] and err <= atol, err

    checks: dict[str, Any] = {}
    for i, (a, b) in enumerate(zip(other["outputs"], one["outputs"], strict=True)):
        checks[f"request {i} equals one rank"], checks[f"request {i} max err"] = same(a, b)
    for i, (a, b) in enumerate(zip(other["untraced_outputs"], one["untraced_outputs"],
                                   strict=True)):
        checks[f"untraced request {i} equals one rank"], _ = same(a, b)
    if other["cuda"]:  # vLLM's V2 runner fills the index on the device on CUDA only
        checks["untraced steps filled on the device on every rank"] = all(
            f.get("device", 0) > 0 and f.get("host", 0) == 0
            for f in other["untraced_index_fills"])
    checks["global equals one rank"], _ = same(other["global"], one["global"])
    checks["cleared equals unsteered"], _ = same(other["cleared"], one["outputs"][0])
    checks["global changed the output"] = bool(
        np.abs(np.array(other["global"]["logprobs"])
               - np.array(other["cleared"]["logprobs"])).max() > 1e-2)
    checks["capture equals one rank"] = all(
        np.allclose(np.array(x), np.array(y), atol=2e-4)
        for site in one["capture"]
        for x, y in zip(other["capture"][site], one["capture"][site], strict=True))
    ranks = other["ranks"]
    checks["controller checksums equal on every rank"] = (
        len(ranks) >= 2 and len({r["controller_checksum"] for r in ranks}) == 1
        and len({r["controller_checked_steps"] for r in ranks}) == 1
        and ranks[0]["controller_checked_steps"] > 0)
    checks["no rank ran out of rows"] = all(r["rows_rejected"] == 0 for r in ranks)
    checks["gates, scores and controller events equal on every rank"] = all(
        all(t == tele[0] for t in tele) for tele in other["per_rank_telemetry"])
    checks.update(guard_checks(other["guard"], one["guard"]))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layouts", default="tp2,pp2")
    parser.add_argument("--atol", type=float, default=2e-3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        run_layout(args.child, args.model, args.out / f"parallel_{args.child}.json")
        return 0

    import torch
    from tiny_models import make_tiny_model

    model = args.out / "tiny_llama"
    if not (model / "config.json").exists():
        make_tiny_model("llama", model)
    env = {**os.environ, **(GPU_TP_ENV if torch.cuda.is_available() else
                            {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})}
    layouts = ["tp1", *(x for x in args.layouts.split(",") if x)]
    results: dict[str, Any] = {}
    for layout in layouts:
        child_env = env if layout != "tp1" else {**env, "VLLM_CPU_OMP_THREADS_BIND": "auto"}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-u", __file__, str(args.out), "--child", layout,
                               "--model", str(model)], env=child_env)
        results[layout] = {"rc": done.returncode, "seconds": time.monotonic() - started}
        print(f"{layout}: rc {done.returncode} in {results[layout]['seconds']:.0f} s",
              flush=True)
    one = json.loads((args.out / "parallel_tp1.json").read_text())
    results["tp1"]["checks"] = guard_checks(one["guard"], None)
    failed = [f"tp1: {k}" for k, v in results["tp1"]["checks"].items() if not v]
    for layout in layouts[1:]:
        path = args.out / f"parallel_{layout}.json"
        if results[layout]["rc"] != 0 or not path.exists():
            failed.append(f"{layout}: did not run")
            continue
        checks = compare(one, json.loads(path.read_text()), args.atol)
        results[layout]["checks"] = checks
        failed += [f"{layout}: {k}" for k, v in checks.items() if v is False]
        passed = sum(v is True for v in checks.values())
        print(f"{layout}: {passed}/{sum(isinstance(v, bool) for v in checks.values())} checks "
              "passed", flush=True)
    results["failed"] = failed
    (args.out / "parallel_check.json").write_text(json.dumps(results, indent=1))
    print("\n".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
