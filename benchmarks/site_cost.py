"""GPU cost of one steering site inside a compiled layer stack, by how the site is written.

A stack of 32 "layers" (``x = rmsnorm(x + h) * w``, bf16, the part of a decoder layer a
``post_block`` site sits in), compiled by Inductor and replayed as one CUDA graph, with no
steered token (every token on row 0, the serving default). Variants of the site:

* ``none``     no site (stock);
* ``op``       the ``dynsteer::steer`` op (the Triton kernel) before each norm;
* ``gather``   the add written as plain row gathers (``table[row]``), fused into the norm;
* ``fused``    :func:`dynsteer.engine_ext.worker.ops.steer_add`: the same add with row 0 read
               as padding, so that unsteered tokens load no row (Inductor masks the load).

Prints microseconds per stack (median of repeated graph replays) and the ratio to ``none``
for 1, 32, 256 and 2048 tokens; writes ``site_cost.json``.

Usage: python benchmarks/site_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

LAYERS = 32
HIDDEN = 4096
TOKENS = (1, 32, 256, 2048)
VARIANTS = ("none", "op", "gather", "fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from dynsteer.engine_ext.worker import ops

    device = torch.device("cuda")
    rows, max_tokens = 65, max(TOKENS)
    buffers = ops.SteerBuffers(
        index=torch.zeros(ops.INDEX_ROWS, max_tokens, dtype=torch.int32, device=device),
        gate_score=torch.zeros(2, max_tokens, device=device),
        table=torch.zeros(rows, HIDDEN, device=device),
        dyn=torch.zeros(rows, HIDDEN, device=device),
        flags=torch.zeros(rows, dtype=torch.int32, device=device),
        probes=torch.zeros(2, HIDDEN, device=device), params=torch.zeros(2, 3, device=device),
        capture=torch.zeros(1, 2, HIDDEN, device=device),
        site_lane=torch.full((LAYERS,), -1, dtype=torch.int32, device=device),
        control=torch.zeros(1, ops.CTL_COLS, device=device))
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)

    def gather_add(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        r = buffers.index[ops.INDEX_ROW, :n].to(torch.long)
        g = buffers.gate_score[ops.GATE, :n, None]
        x32 = x.float()
        y = x32 + buffers.table[r] + g * buffers.dyn[r]
        y = torch.where(y.abs() <= ops.stream_limit(x.dtype), y, x32)
        return y.to(x.dtype)

    def site(variant: str, x: torch.Tensor, layer: int) -> torch.Tensor:
        if variant == "op":
            return torch.ops.dynsteer.steer(x, None, *buffers, layer)
        if variant == "fused":
            return ops.steer_add(x, buffers.index, buffers.gate_score, buffers.table,
                                 buffers.dyn)
        if variant == "gather":
            return gather_add(x)
        return x

    def stack(variant: str):
        def forward(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            for layer in range(LAYERS):
                x = site(variant, x + h, layer)
                var = x.float().pow(2).mean(-1, keepdim=True)
                h = (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight
            return x + h
        return torch.compile(forward, fullgraph=True)

    results: dict[str, dict[str, float]] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        h = torch.randn_like(x)
        for variant in VARIANTS:
            fn = stack(variant)
            for _ in range(3):
                fn(x, h)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(x, h)
            times = []
            for _ in range(30):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(20):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / 20)
            results.setdefault(str(tokens), {})[variant] = statistics.median(times)
            torch._dynamo.reset()
    print(f"{'tokens':>7} " + " ".join(f"{v + ' us':>10} {'ratio':>7}" for v in VARIANTS))
    for tokens, row in results.items():
        print(f"{tokens:>7} " + " ".join(f"{row[v]:>10.1f} {row[v] / row['none']:>7.4f}"
                                         for v in VARIANTS))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "site_cost.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "layers": LAYERS, "hidden": HIDDEN,
         "us_per_stack": results}, indent=2))


if __name__ == "__main__":
    main()
