"""Throughput overhead of dynsteer against stock vLLM, side by side in one process tree (GPU).

A Llama-8B-shaped model with dummy weights (bf16, CUDA graphs and torch.compile on, vLLM
defaults otherwise). Engines live at the same time and runs alternate between them, so drift
of the machine hits all of them alike:

* ``stock``              stock vLLM (plugin installed, not enabled);
* ``all-sites``          plugin enabled with the default sites (``post_block`` at all 32 layers);
* ``one-site``           plugin enabled with one site (``post_block@16``).

Scenarios: the plugin engines with no steering traffic (``idle``) and with every request
steered at layer 16 (``steered``, a registered vector named in each request's spec).
Each run: BATCH prompts of 128 random tokens, 128 generated
tokens (greedy, ignore_eos). Prints a table (tokens/s = generated tokens / wall time, median of
the repetitions, ratio to stock) and writes JSON.

Usage: python benchmarks/overhead.py --out DIR [--batches 1 32 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
}
PROMPT_LEN = 128
GEN_LEN = 128
STEER_LAYER = 16


def make_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    return folder


def start(path: Path, dynsteer: dict[str, Any] | None, mem: float) -> Any:
    from vllm import LLM

    extra = {"additional_config": {"dynsteer": dynsteer}} if dynsteer is not None else {}
    return LLM(str(path), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
               max_model_len=PROMPT_LEN + GEN_LEN + 16, max_num_seqs=256,
               gpu_memory_utilization=mem, seed=0, **extra)


def workload(batch: int, steered: bool) -> tuple[list[dict[str, Any]], list[Any]]:
    import numpy as np
    from vllm import SamplingParams

    rng = np.random.default_rng(batch)
    prompts = [{"prompt_token_ids": rng.integers(100, 30000, PROMPT_LEN).tolist()}
               for _ in range(batch)]
    extra = None
    if steered:
        extra = {"dynsteer": {"steer": [{"vector": "bench", "layers": [STEER_LAYER]}]}}
    sp = SamplingParams(max_tokens=GEN_LEN, temperature=0.0, ignore_eos=True, detokenize=False,
                        extra_args=extra)
    return prompts, [sp] * batch


def timed(llm: Any, prompts: list[dict[str, Any]], sps: list[Any]) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == GEN_LEN for o in outs)
    return len(prompts) * GEN_LEN / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mem", type=float, default=0.28, help="gpu_memory_utilization per engine")
    args = ap.parse_args()
    import numpy as np
    import torch
    import vllm

    from dynsteer.engine_ext import Steering

    configs = {"stock": None, "all-sites": {}, "one-site": {"sites": f"post_block@{STEER_LAYER}"}}
    scenarios = [("stock", False), ("all-sites", False), ("all-sites", True),
                 ("one-site", False), ("one-site", True)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "llama8b")
        t0 = time.time()
        engines = {name: start(path, cfg, args.mem) for name, cfg in configs.items()}
        startup = time.time() - t0
        vec = np.random.default_rng(0).standard_normal(LLAMA_8B["hidden_size"]) * 0.01
        for name, cfg in configs.items():
            if cfg is not None:
                Steering(engines[name]).register_vector("bench", vec)
        results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "vllm": vllm.__version__,
                                   "startup_s": startup, "runs": {}}
        for batch in args.batches:
            loads = {s: workload(batch, s) for s in (False, True)}
            for name, steered in scenarios:  # warm-up: first pass of each shape
                timed(engines[name], *loads[steered])
            samples: dict[str, list[float]] = {f"{n}/{'steered' if s else 'idle'}": []
                                               for n, s in scenarios}
            for rep in range(args.reps):
                order = scenarios if rep % 2 == 0 else scenarios[::-1]
                for name, steered in order:
                    key = f"{name}/{'steered' if steered else 'idle'}"
                    samples[key].append(timed(engines[name], *loads[steered]))
            results["runs"][str(batch)] = samples
    print(f"device: {results['device']}  vLLM {results['vllm']}  reps={args.reps}")
    print(f"{'batch':>5} {'scenario':<22} {'tok/s (median)':>15} {'ratio':>7} {'spread':>7}")
    summary = {}
    for batch, samples in results["runs"].items():
        stock = statistics.median(samples["stock/idle"])
        for key, values in samples.items():
            med = statistics.median(values)
            spread = (max(values) - min(values)) / med
            summary[f"{batch}/{key}"] = {"tok_s": med, "ratio": med / stock, "spread": spread}
            print(f"{batch:>5} {key:<22} {med:>15.1f} {med / stock:>7.4f} {spread:>7.2%}")
    results["summary"] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
