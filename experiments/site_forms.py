"""How a fused site should skip the tiers its row does not use there: formulations compared.

``benchmarks/site_cost.py``'s stack (32 x (site, add, RMSNorm), bf16, hidden 4096, compiled, one
CUDA graph) with the site written in several ways, under idle traffic (every token on row 0)
and registered traffic (every token on row 1, static at layer 16 only). For each: microseconds
per stack, Triton kernels per stack, and the generated code (``code_NAME.py``). Forms:

* ``unmasked``   the token's row, both tiers, at every site (the form of session 11);
* ``flags``      the row's flags at the site read through the padded row (a second, dependent
                 load), then both tiers masked by them;
* ``flags-raw``  the same with the flags read as a plain gather;
* ``split``      two shared index rows, static and gated (no per-site information): a static
                 request never loads the gated tier, but loads its static row at every site;
* ``per-site``   a per-site index ``[S, T]`` computed on the device once per step, outside the
                 graph (static row in the low 16 bits, gated row in the high 16): one load per
                 site, both tiers masked; the cost of computing it is timed apart (``prep``).

Experiment code, not the product: every form is exact for the traffic it runs here. In this
stack ``per-site`` is the best (registered traffic as cheap as idle, prefill far cheaper); in
the 8B engine a per-site index cost 0.7-1% of the idle decode step more than the shared one
(``benchmarks/RESULTS.md``, session 12), so the product keeps the shared index.

Usage: python experiments/site_forms.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from site_cost import cuda_us, graph_of, replay_us

from dynsteer.engine_ext.worker import ops

LAYERS, HIDDEN, ROWS, STEERED = 32, 4096, 65, 16
TOKENS = (1, 32, 256, 2048)
FORMS = ("unmasked", "flags", "flags-raw", "split", "per-site")


class Buffers:
    def __init__(self, device: torch.device) -> None:
        t = max(TOKENS)
        self.index = torch.zeros(ops.INDEX_ROWS + 1, t, dtype=torch.int32, device=device)
        self.site_index = torch.zeros(LAYERS, t, dtype=torch.int32, device=device)
        self.gate_score = torch.zeros(2, t, device=device)
        self.table = torch.zeros(LAYERS, ROWS, HIDDEN, device=device)
        self.dyn = torch.zeros(LAYERS, ROWS, HIDDEN, device=device)
        self.flags = torch.zeros(LAYERS, ROWS, dtype=torch.int32, device=device)
        self.table[STEERED, 1] = torch.randn(HIDDEN, device=device) * 0.01
        self.flags[STEERED, 1] = ops.STATIC_FLAG

    def set_traffic(self, registered: bool) -> None:
        row = int(registered)
        self.index.zero_()
        self.index[ops.INDEX_ROW] = row  # split: static row here, gated row (none) in the last
        self.prep()

    def prep(self) -> None:
        """The per-site index from the shared one: what the worker would run once per step."""
        rows = self.index[ops.INDEX_ROW].long()
        f = self.flags[:, rows]                                   # [S, T]
        static = torch.where((f & ops.STATIC_FLAG) != 0, rows, 0)
        gated = torch.where((f & ops.DYNAMIC_FLAG) != 0, rows, 0)
        self.site_index.copy_(static | (gated << 16))


def _finish(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 + ops._within_limit(x32, None, delta, x.dtype)).to(x.dtype)


def site(form: str, b: Buffers, x: torch.Tensor, s: int) -> torch.Tensor:
    n = x.shape[0]
    gate = b.gate_score[ops.GATE, :n, None]
    table, dyn = b.table[s], b.dyn[s]
    if form == "per-site":
        packed = b.site_index[s, :n].long()
        static, gated = packed & 0xFFFF, packed >> 16
    elif form == "split":
        static = b.index[ops.INDEX_ROW, :n].long()
        gated = b.index[ops.INDEX_ROWS, :n].long()
    else:
        rows = b.index[ops.INDEX_ROW, :n].long()
        if form == "unmasked":
            static = gated = rows
        else:
            f = b.flags[s][rows] if form == "flags-raw" else ops._row_of(b.flags[s], rows)
            static = torch.where((f & ops.STATIC_FLAG) != 0, rows, 0)
            gated = torch.where((f & ops.DYNAMIC_FLAG) != 0, rows, 0)
    return _finish(x, ops._row_of(table, static) + gate * ops._row_of(dyn, gated))


def stack(form: str, b: Buffers):
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=b.table.device)

    def forward(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        for s in range(LAYERS):
            x = site(form, b, x + h, s)
            var = x.float().pow(2).mean(-1, keepdim=True)
            h = (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight
        return x + h
    return torch.compile(forward, fullgraph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from torch._inductor.utils import run_and_get_code

    args.out.mkdir(parents=True, exist_ok=True)
    b = Buffers(torch.device("cuda"))
    results: dict[str, dict[str, dict[str, float]]] = {}
    kernels: dict[str, int] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        h = torch.randn_like(x)
        for form in ("none", *FORMS):
            b.set_traffic(False)
            if form == "none":
                weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")

                def plain(x, h, weight=weight):
                    for _ in range(LAYERS):
                        x = x + h
                        var = x.float().pow(2).mean(-1, keepdim=True)
                        h = (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight
                    return x + h
                fn = torch.compile(plain, fullgraph=True)
            else:
                fn = stack(form, b)
            _, codes = run_and_get_code(fn, x, h)
            if tokens == 32:
                kernels[form] = sum(code.count("@triton.jit") for code in codes)
                (args.out / f"code_{form}.py").write_text("\n\n".join(codes))
            graph = graph_of(fn, x, h)
            for traffic in ("idle", "registered"):
                b.set_traffic(traffic == "registered")
                results.setdefault(traffic, {}).setdefault(str(tokens), {})[form] = \
                    replay_us(graph)
            torch._dynamo.reset()
    b.set_traffic(True)
    prep_us = cuda_us(b.prep, 100, timings=1)
    forms = ("none", *FORMS)
    for traffic, by_tokens in results.items():
        print(f"\n{traffic}\n{'tokens':>7} " + " ".join(f"{f:>10}" for f in forms))
        for tokens, row in by_tokens.items():
            print(f"{tokens:>7} " + " ".join(f"{row[f]:>10.1f}" for f in forms))
    print(f"\ndistinct Triton kernels per stack (32 tokens): {kernels}")
    print(f"per-site prep (eager torch, {max(TOKENS)} columns): {prep_us:.1f} us per step")
    (args.out / "site_forms.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "us_per_stack": results, "kernels": kernels,
         "prep_us": prep_us}, indent=2))


if __name__ == "__main__":
    main()
