"""Throughput of activation capture against stock vLLM, side by side (GPU; ``--tiny`` on CPU).

A Llama-8B-shaped model with dummy weights (bf16, torch.compile and CUDA graphs on) in two
engines that live at the same time: ``stock`` (no dynsteer) and ``capture`` (dynsteer with
four capture sites, ``post_block`` at layers 8, 16, 24 and 31, as monitor sites, four capture
lanes and rows for a whole batch). Scenarios, run in alternation (order reversed every
repetition), each on fresh random prompts:

* ``plain``       requests without a capture on the capture engine;
* ``returned-1``  every request captures one site at all positions as float16, collected with
                  one ``Steering.activations(outputs)`` call for the batch (timed);
* ``sink-4``      every request captures all four sites at all positions as float16 into the
                  capture engine's own sink (``dynsteer.capture_sinks``, a temporary folder:
                  the workers write rows as the requests run), timed until its shards are
                  sealed (``Steering.flush_capture_sinks``); the sink's MB/s is reported;
* ``training``    the probe-training path: ``Steering.capture`` of ``--train-prompts`` prompts
                  of the prompt length at the four sites (``reduce="mean"``), against stock's
                  prefill of the same prompts (``max_tokens=1``): prompt tokens/s.

Generation scenarios report generated tokens per second of wall time (median of the
repetitions) and the ratio to stock's in the same run (the issue's targets: ``plain`` at least
0.99, ``returned-1`` 0.90, ``sink-4`` 0.85, ``training`` 0.5 of stock's prefill).

With ``--peer-lens DIR``, vllm-lens (installed in DIR) runs the same traffic first, in a
process of its own (:mod:`capture_lens`): its rows report the ratio to stock and, as ``own``,
to its own eager engine.

Run on the GPU host: ``python -u benchmarks/capture.py --batches 32 256 --out $OUT/capture.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import capture_lens
from bench_model import dummy_model
from overhead import LLAMA_8B, prompts
from sigterm import exits_on_sigterm

SITES = ["post_block@8", "post_block@16", "post_block@24", "post_block@31"]
TINY = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
        "torch_dtype": "float32"}
"""A small model of the same depth, for a CPU run of the script (``--tiny``)."""
GENERATION = ("plain", "returned-1", "sink-4")


def start(path: Path, dynsteer: dict[str, Any] | None, args: argparse.Namespace) -> Any:
    from vllm import LLM

    if args.tiny:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU builds: a small KV cache
    extra = {"additional_config": {"dynsteer": dynsteer}} if dynsteer is not None else {}
    gpu = {} if args.tiny else {"gpu_memory_utilization": args.memory}
    return LLM(str(path), load_format="dummy", dtype="float32" if args.tiny else "bfloat16",
               skip_tokenizer_init=True, max_model_len=args.prompt + args.gen + 16,
               max_num_seqs=max(args.batches), seed=0, **gpu, **extra)


def capture_options(args: argparse.Namespace, sink: Path) -> dict[str, Any]:
    """The capture engine's options: rows for every request of the largest batch, and the
    sink ``bench`` in the folder ``sink``."""
    rows = max(args.batches) * (args.prompt + args.gen) + 1
    rows = max(rows, args.prompt * args.train_prompts // 4 + 1)
    return {"sites": ",".join(SITES), "monitor_sites": ",".join(SITES), "capture_lanes": 4,
            "capture_tokens": rows, "capture_sinks": {"bench": str(sink)}}


def spec(scenario: str) -> dict[str, Any] | None:
    if scenario == "returned-1":
        return {"capture": {"sites": SITES[1], "positions": "all", "dtype": "float16"}}
    if scenario == "sink-4":
        return {"capture": {"sites": SITES, "positions": "all", "dtype": "float16",
                            "sink": "bench"}}
    return None


def generate(llm: Any, scenario: str, batch: int, args: argparse.Namespace, seed: int
             ) -> dict[str, float]:
    """One timed run: generated tokens/s (and the sink's MB/s)."""
    from vllm import SamplingParams

    from dynsteer.engine_ext import Steering

    wanted = spec(scenario)
    params = [SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True,
                             detokenize=False,
                             extra_args={"dynsteer": wanted} if wanted else None)
              for _ in range(batch)]
    batch_prompts = prompts(batch, args.prompt, seed)
    sink = scenario == "sink-4"
    before = Steering(llm).flush_capture_sinks()["bench"] if sink else {}
    t0 = time.perf_counter()
    outs = llm.generate(batch_prompts, params, use_tqdm=False)
    if sink:
        after = Steering(llm).flush_capture_sinks()["bench"]
        held = after["requests"] - before["requests"]
        if held != batch:
            raise RuntimeError(f"{scenario}: the sink holds {held} of {batch} requests "
                               f"({after['dropped']} dropped)")
    elif wanted is not None:
        for acts in Steering(llm).activations(outs):
            if acts is None or acts.status != "ok":
                raise RuntimeError(f"{scenario}: capture {acts and acts.status}")
    wall = time.perf_counter() - t0
    result = {"tokens_per_s": batch * args.gen / wall}
    if sink:
        result["sink_mb_per_s"] = (after["bytes"] - before["bytes"]) / wall / 1e6
    return result


def prefill(llm: Any, args: argparse.Namespace, seed: int, training: bool) -> float:
    """Prompt tokens/s: stock's prefill (``max_tokens=1``) or the probe-training capture."""
    from vllm import SamplingParams

    from dynsteer.engine_ext import Steering

    batch_prompts = prompts(args.train_prompts, args.prompt, seed)
    t0 = time.perf_counter()
    if training:
        Steering(llm).capture([p["prompt_token_ids"] for p in batch_prompts], SITES, "mean")
    else:
        llm.generate(batch_prompts, SamplingParams(max_tokens=1, detokenize=False),
                     use_tqdm=False)
    return args.train_prompts * args.prompt / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--train-prompts", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory", type=float, default=0.4,
                        help="GPU memory share of each engine")
    parser.add_argument("--tiny", action="store_true",
                        help="a small model of the same depth in float32 (a CPU run)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peer-lens", type=Path, default=None, metavar="DIR",
                        help="also run vllm-lens, installed in DIR, as a peer row in a "
                             "process of its own (see capture_lens.py)")
    parser.add_argument("--lens-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    path = dummy_model("capture-tiny" if args.tiny else "llama8b",
                       TINY if args.tiny else LLAMA_8B)
    if args.lens_out is not None:  # the peer's own process
        return capture_lens.main(args, path, start, SITES)
    runs: dict[str, list[dict[str, float]]] = {}
    if args.peer_lens is not None:  # first, so its engine has the device to itself
        runs.update(peer_lens(args, argv if argv is not None else sys.argv[1:]))
    seed = 0
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"stock": start(path, None, args),
                   "capture": start(path, capture_options(args, Path(tmp)), args)}
        for rep in range(args.reps):
            order = [("stock", "stock"), *(("capture", s) for s in GENERATION)]
            for batch in args.batches:
                for engine, scenario in order if rep % 2 == 0 else order[::-1]:
                    seed += 1
                    result = generate(engines[engine], scenario, batch, args, seed)
                    runs.setdefault(f"{scenario}@{batch}", []).append(result)
            for name, training in (("stock-prefill", False), ("training", True)):
                seed += 1
                engine = engines["capture" if training else "stock"]
                runs.setdefault(name, []).append(
                    {"tokens_per_s": prefill(engine, args, seed, training)})
    table = summarize(runs, args.batches, args.peer_lens is not None)
    for row, value in table.items():
        print(f"{row:24s} " + "  ".join(f"{k} {v:.4g}" for k, v in value.items()), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "runs": runs, "table": table}, indent=1, default=str))
    return table


def peer_lens(args: argparse.Namespace, argv: list[str]) -> dict[str, list[dict[str, float]]]:
    """The runs of :mod:`capture_lens` in a process of its own, with only vllm-lens loaded."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lens.json"
        env = {**os.environ, "VLLM_PLUGINS": "activations",
               "PYTHONPATH": os.pathsep.join(filter(None, [
                   str(args.peer_lens), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-u", __file__, *argv, "--lens-out", str(out)],
                       env=env, check=True)
        return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict[str, float]]], batches: list[int],
              lens: bool = False) -> dict[str, dict[str, float]]:
    """Median tokens/s per scenario and its ratio to stock's (generation: stock at the same
    batch; training: stock's prefill); vllm-lens's rows (``lens``) also with ``own``, the
    ratio to its own plain requests (eager) or prefill."""
    def median(key: str, field: str = "tokens_per_s") -> float:
        return statistics.median(r[field] for r in runs[key])

    table: dict[str, dict[str, float]] = {}
    for batch in batches:
        stock = median(f"stock@{batch}")
        table[f"stock@{batch}"] = {"tokens_per_s": stock}
        for scenario in GENERATION:
            key = f"{scenario}@{batch}"
            table[key] = {"tokens_per_s": median(key), "ratio": median(key) / stock}
            if scenario == "sink-4":
                table[key]["sink_mb_per_s"] = median(key, "sink_mb_per_s")
    table["training"] = {"tokens_per_s": median("training"),
                         "ratio": median("training") / median("stock-prefill")}
    if not lens:
        return table
    for batch in batches:
        stock, own = median(f"stock@{batch}"), median(f"lens-plain@{batch}")
        for name in capture_lens.SCENARIOS:
            key = f"{name}@{batch}"
            table[key] = {"tokens_per_s": median(key), "ratio": median(key) / stock,
                          "own": median(key) / own}
    table["lens-training"] = {"tokens_per_s": median("lens-training"),
                              "ratio": median("lens-training") / median("stock-prefill"),
                              "own": median("lens-training") / median("lens-prefill")}
    return table


if __name__ == "__main__":
    exits_on_sigterm(main)()
