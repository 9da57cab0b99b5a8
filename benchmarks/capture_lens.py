"""vllm-lens as a peer row of ``capture.py``: the same model, sites and traffic, in a process
of its own (``capture.py --peer-lens DIR`` starts it).

vllm-lens (PyPI ``vllm-lens``, MIT, UK AISI) is a vLLM plugin that returns the residual stream
after chosen decoder layers with each output (``extra_args={"output_residual_stream":
[layers]}``; the same stream as dynsteer's ``post_block@layer``). It loads in every vLLM
process once installed and forces eager mode on every engine there, so it cannot share a
process with ``capture.py``'s compiled engines: install it into a folder of its own (``pip
install --no-deps --ignore-requires-python --target DIR vllm-lens==1.3.0 zstandard``) and this
module runs with ``PYTHONPATH=DIR VLLM_PLUGINS=activations``.

Scenarios, in alternation (order reversed every repetition), each on fresh random prompts:
``lens-plain`` (requests without capture on the lens engine: eager vLLM), ``lens-returned-1``
(one layer, every position, with the output), ``lens-returned-4`` (the four layers), and
``lens-prefill`` / ``lens-training`` (the prompts of ``--train-prompts`` with ``max_tokens=1``,
without and with the four layers). Results go to ``--out`` as ``capture.py``'s ``runs``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overhead import prompts

SCENARIOS = ("lens-plain", "lens-returned-1", "lens-returned-4")


def run(llm: Any, layers: list[int] | None, count: int, length: int, max_tokens: int,
        seed: int) -> float:
    """Seconds to serve ``count`` fresh prompts and hold every request's activations."""
    from vllm import SamplingParams

    extra = {"output_residual_stream": layers} if layers else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False, extra_args=extra)
    t0 = time.perf_counter()
    outs = llm.generate(prompts(count, length, seed), params, use_tqdm=False)
    if layers:
        for out in outs:
            stream = (getattr(out, "activations", None) or {}).get("residual_stream")
            if stream is None or stream.shape[0] != len(layers):
                raise RuntimeError(f"vllm-lens returned {None if stream is None else stream.shape}"
                                   f" for layers {layers}")
    return time.perf_counter() - t0


def main(args: argparse.Namespace, path: Path, start: Callable[..., Any],
         sites: list[str]) -> dict[str, list[dict[str, float]]]:
    """The runs, in ``capture.py``'s form; ``start(path, None, args)`` starts the engine and
    ``sites`` are ``capture.py``'s (``post_block@L``: the output of decoder layer ``L``)."""
    layers = [int(site.split("@")[1]) for site in sites]
    llm = start(path, None, args)
    runs: dict[str, list[dict[str, float]]] = {}
    seed = 10_000
    for rep in range(args.reps):
        order = list(zip(SCENARIOS, (None, layers[1:2], layers), strict=True))
        for batch in args.batches:
            for name, wanted in order if rep % 2 == 0 else order[::-1]:
                seed += 1
                wall = run(llm, wanted, batch, args.prompt, args.gen, seed)
                runs.setdefault(f"{name}@{batch}", []).append(
                    {"tokens_per_s": batch * args.gen / wall})
        for name, wanted in (("lens-prefill", None), ("lens-training", layers)):
            seed += 1
            wall = run(llm, wanted, args.train_prompts, args.prompt, 1, seed)
            runs.setdefault(name, []).append(
                {"tokens_per_s": args.train_prompts * args.prompt / wall})
    if args.lens_out is not None:
        args.lens_out.write_text(json.dumps(runs))
    return runs
