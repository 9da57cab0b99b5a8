"""GPU kernel launches per decode step: stock vLLM against the plugin idle, steered and gated.

What a site costs the graph, counted rather than timed: a Llama with 32 layers (small widths,
the count does not depend on them), torch.compile on, vLLM in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and CUDA graphs off so that the profiler sees every
kernel the compiled forward launches (with graphs on, the same kernels are the graph's nodes).
Per engine: kernels of a 1-token generation and of a 33-token one, both greedy; the difference
over 32 is the kernels of one decode step (memcpy and memset counted apart) and their summed
GPU time. ``--shape 8b --batch 32`` runs the Llama-8B shape of ``overhead.py`` instead, where
the GPU time per step says whether a difference in throughput is on the GPU or the host.

Configs: ``stock`` (plugin not enabled), ``idle`` (default sites: ``post_block`` at all 32
layers, 3 of them monitor sites), ``static`` (one registered vector at 8 layers, none of them a
monitor site), ``gated`` (a probe at ``post_block@16`` gating that vector at layers 16-23), and
on a third engine with one projection slot per site (``max_projections: 1``) ``ablate`` (that
vector's direction ablated at layers 16-23, one of them a monitor site) and ``gated+slots``
(``gated`` again, to tell what the slots cost from what ablating costs).

``--engine NAME`` instead measures idle traffic (no request steered) on one engine of
:data:`ENGINES` in this process and writes ``launches_NAME.json`` with the GPU time per decode
step of every kernel name; ``--compare DIR`` then prints, per engine, the kernels whose time
differs most from stock's: where an idle plugin's GPU time goes (the monitor kernels, the
norms the fused sites join, or something else).

Usage: python benchmarks/launches.py --out DIR [--shape small|8b] [--batch N]
       (writes launches.json)
       python benchmarks/launches.py --out DIR --shape 8b --batch 32 --engine idle
       python benchmarks/launches.py --compare DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from overhead import LLAMA_8B

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SHAPE = {**LLAMA_8B, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 16,
         "vocab_size": 32000, "max_position_embeddings": 4096}
"""The 8B shape's 32 layers at small widths."""
STATIC_LAYERS = [1, 3, 5, 7, 9, 11, 13, 15]
GATED_LAYERS = list(range(16, 24))
DECODE_STEPS = 32


ENGINES: dict[str, dict[str, Any] | None] = {
    "stock": None,
    "idle": {},
    "no-monitors": {"monitor_sites": ""},
    "one-site": {"sites": "post_block@16", "monitor_sites": ""},
    "monitors-only": {"sites": "post_block@25%+50%+75%"},
}
"""Engines ``--engine`` measures idle: stock; the default sites; every site fused, none a
monitor site; one fused site; the three default monitor sites alone."""


def specs() -> dict[str, dict[str, Any] | None]:
    gated = [{"vector": "bench", "layers": GATED_LAYERS}]
    return {
        "idle": None,
        "static": {"steer": [{"vector": "bench", "layers": STATIC_LAYERS}]},
        "gated": {"gate": {"probe": "bench", "layer": 16, "steer": gated}},
    }


def projection_specs() -> dict[str, dict[str, Any] | None]:
    """The configs of the engine with projection slots."""
    return {
        "ablate": {"steer": [{"vector": "bench", "layers": GATED_LAYERS, "op": "ablate"}]},
        "gated+slots": specs()["gated"],
    }


def count_kernels(llm: Any, spec: dict[str, Any] | None, max_tokens: int,
                  batch: int, copies: bool = False) -> dict[str, float]:
    """CUDA activities of one greedy generation of ``batch`` prompts, by kind, and the kernels'
    summed GPU time (us); with ``copies``, also prints the host ops that issued copies (with
    their input shapes), to find where a config's extra memcpys come from."""
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        detokenize=False,
                        extra_args=None if spec is None else {"dynsteer": json.dumps(spec)})
    prompts = [{"prompt_token_ids": list(range(100 + i, 116 + i))} for i in range(batch)]
    llm.generate(prompts, [sp] * batch, use_tqdm=False)  # warm: nothing new compiled
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if copies:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, record_shapes=copies) as prof:
        llm.generate(prompts, [sp] * batch, use_tqdm=False)
        torch.cuda.synchronize()
    if copies:
        for row in prof.key_averages(group_by_input_shape=True):
            if "copy" in row.key.lower() or "memcpy" in row.key.lower():
                print(f"  {max_tokens} tokens: {row.count:5d} x {row.key} {row.input_shapes}")
    counts: dict[str, float] = {"kernels": 0, "memcpy": 0, "memset": 0, "kernel_us": 0.0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name else "memset" if "memset" in name else "kernels"
        counts[kind] += 1
        if kind == "kernels":
            us = event.time_range.elapsed_us()
            counts["kernel_us"] += us
            counts[f"us:{event.name}"] = counts.get(f"us:{event.name}", 0.0) + us
    return counts


def per_step(llm: Any, spec: dict[str, Any] | None, batch: int,
             copies: bool = False) -> dict[str, float]:
    one = count_kernels(llm, spec, 1, batch, copies)
    many = count_kernels(llm, spec, 1 + DECODE_STEPS, batch, copies)
    return {k: (many[k] - one.get(k, 0.0)) / DECODE_STEPS for k in many}


def start(path: Path, dynsteer: dict[str, Any] | None, mem: float,
          inductor: dict[str, Any] | None = None) -> Any:
    """An engine of the shape at ``path`` (graphs off); ``inductor``: Inductor settings to
    compile under (vLLM's ``inductor_compile_config``)."""
    from vllm import LLM

    extra = {"additional_config": {"dynsteer": dynsteer}} if dynsteer is not None else {}
    compilation: dict[str, Any] = {"cudagraph_mode": "NONE"}
    if inductor:
        compilation["inductor_compile_config"] = inductor
    return LLM(str(path), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
               max_model_len=512, max_num_seqs=256, gpu_memory_utilization=mem, seed=0,
               compilation_config=compilation, **extra)


def one_engine(name: str, shape: dict[str, Any], batch: int, out: Path) -> None:
    """Idle traffic on engine ``name`` of :data:`ENGINES` (alone in this process)."""
    path = Path(tempfile.mkdtemp()) / "llama32"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(shape))
    llm = start(path, ENGINES[name], 0.8)
    result = per_step(llm, None, batch)
    print(f"{name}: {result['kernels']:.1f} kernels, {result['kernel_us']:.1f} GPU us per step")
    (out / f"launches_{name}.json").write_text(json.dumps(
        {"engine": name, "options": ENGINES[name], "shape": shape, "batch": batch,
         "decode_steps": DECODE_STEPS, "per_decode_step": result}, indent=2))


def compare(folder: Path, top: int = 12) -> None:
    """Per engine measured in ``folder``: totals against stock, then the kernel names whose
    GPU time per step moved most."""
    loaded = [json.loads(f.read_text()) for f in sorted(folder.glob("launches_*.json"))]
    runs = {run["engine"]: run["per_decode_step"] for run in loaded}
    stock = runs.pop("stock")
    for name, run in runs.items():
        print(f"\n{name}: {run['kernels'] - stock['kernels']:+.1f} kernels, "
              f"{run['kernel_us'] - stock['kernel_us']:+.1f} us per step "
              f"({run['kernel_us'] / stock['kernel_us']:.4f} of stock's "
              f"{stock['kernel_us']:.1f})")
        names = {k for k in (*run, *stock) if k.startswith("us:")}
        moved = sorted(names, key=lambda k: -abs(run.get(k, 0.0) - stock.get(k, 0.0)))
        for key in moved[:top]:
            print(f"  {run.get(key, 0.0) - stock.get(key, 0.0):+9.2f} us  "
                  f"({stock.get(key, 0.0):9.2f} -> {run.get(key, 0.0):9.2f})  {key[3:][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--engine", choices=sorted(ENGINES),
                        help="measure idle traffic on this engine only (in this process)")
    parser.add_argument("--compare", type=Path, help="print a folder of --engine runs")
    parser.add_argument("--shape", choices=["small", "8b"], default="small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--copies", action="store_true",
                        help="print the host ops that issued copies, per config")
    args = parser.parse_args()
    if args.compare is not None:
        compare(args.compare)
        return
    if args.out is None:
        parser.error("--out is required")
    shape = LLAMA_8B if args.shape == "8b" else SHAPE
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine is not None:
        one_engine(args.engine, shape, args.batch, args.out)
        return
    import numpy as np

    path = Path(tempfile.mkdtemp()) / "llama32"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(shape))
    mem = 0.2 if args.shape == "small" else 0.28  # three engines; vLLM frees none in-process
    results: dict[str, dict[str, float]] = {}
    llm = start(path, None, mem)
    results["stock"] = per_step(llm, None, args.batch)
    del llm
    gc.collect()

    from dynsteer.engine_ext import Steering

    for options, configs in (({}, specs()), ({"max_projections": 1}, projection_specs())):
        llm = start(path, options, mem)
        steering = Steering(llm)
        rng = np.random.default_rng(0)
        hidden = shape["hidden_size"]
        steering.register_vector("bench", rng.standard_normal(hidden).astype(np.float32) * 0.01)
        steering.register_probe("bench", weights=rng.standard_normal(hidden) / hidden**0.5,
                                threshold=0.0, sharpness=1.0)
        for name, spec in configs.items():
            print(f"config {name}")
            results[name] = per_step(llm, spec, args.batch, args.copies)
        del llm, steering
        gc.collect()
    stock = results["stock"]
    print(f"{'config':<11} {'kernels/step':>13} {'vs stock':>9} {'memcpy':>7} {'memset':>7} "
          f"{'GPU us/step':>12} {'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<11} {r['kernels']:>13.1f} {r['kernels'] - stock['kernels']:>+9.1f} "
              f"{r['memcpy']:>7.1f} {r['memset']:>7.1f} {r['kernel_us']:>12.1f} "
              f"{r['kernel_us'] / stock['kernel_us']:>7.4f}")
    (args.out / "launches.json").write_text(json.dumps(
        {"shape": shape, "batch": args.batch, "decode_steps": DECODE_STEPS,
         "per_decode_step": results}, indent=2))


if __name__ == "__main__":
    main()
