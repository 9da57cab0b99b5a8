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

Usage: python benchmarks/launches.py --out DIR [--shape small|8b] [--batch N]
       (writes launches.json)
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
    counts = {"kernels": 0, "memcpy": 0, "memset": 0, "kernel_us": 0.0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name else "memset" if "memset" in name else "kernels"
        counts[kind] += 1
        if kind == "kernels":
            counts["kernel_us"] += event.time_range.elapsed_us()
    return counts


def per_step(llm: Any, spec: dict[str, Any] | None, batch: int,
             copies: bool = False) -> dict[str, float]:
    one = count_kernels(llm, spec, 1, batch, copies)
    many = count_kernels(llm, spec, 1 + DECODE_STEPS, batch, copies)
    return {k: (many[k] - one[k]) / DECODE_STEPS for k in one}


def start(path: Path, dynsteer: dict[str, Any] | None, mem: float) -> Any:
    from vllm import LLM

    extra = {"additional_config": {"dynsteer": dynsteer}} if dynsteer is not None else {}
    return LLM(str(path), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
               max_model_len=512, max_num_seqs=256, gpu_memory_utilization=mem, seed=0,
               compilation_config={"cudagraph_mode": "NONE"}, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=["small", "8b"], default="small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--copies", action="store_true",
                        help="print the host ops that issued copies, per config")
    args = parser.parse_args()
    shape = LLAMA_8B if args.shape == "8b" else SHAPE
    args.out.mkdir(parents=True, exist_ok=True)
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
