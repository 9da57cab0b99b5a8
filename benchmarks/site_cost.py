"""GPU cost of the steering sites inside a compiled layer stack, by how a site is written.

A stack of 32 "layers" (``x = rmsnorm(x + h) * w``, bf16, the part of a decoder layer a
``post_block`` site sits in), each with its own site tables as in the worker (``table`` /
``dyn`` / ``flags`` per site), compiled by Inductor and replayed as one CUDA graph. Variants of
the site:

* ``none``      no site (stock);
* ``op``        the ``dynsteer::steer`` op (the Triton kernel) before each norm;
* ``gather``    the add written as plain row gathers (``table[row]``), fused into the norm;
* ``fused``     :func:`dynsteer.engine_ext.worker.ops.steer_add`: the same add with row 0 read
                as padding, so that unsteered tokens load no row (Inductor masks the load); a
                steered token loads both tiers of its row at every site;
* ``gate_masked`` ``fused`` with the dynamic tier read only where the token's gate is open (a
                statically steered token loads one row per site): 6 us per stack faster here
                for registered traffic, 0.8% of a decode step slower in the engine, idle
                included (``benchmarks/RESULTS.md``, session 14);
* ``index``     only the token's index entry read (nothing steered): the floor of any site that
                reads per-token data inside the norm kernel.

``experiments/site_forms.py`` times forms that skip the rows where a row does not steer.

Three kinds of traffic: ``idle`` (every token on row 0, the serving default), ``registered``
(every token on one row with a static vector at layer 16 only, what ``overhead.py``'s
``registered`` scenario sends) and ``gated`` (the same with every token's gate at 1).

``--gemm [N]`` puts a GEMM (bf16, ``HIDDEN x HIDDEN``, N distinct 32 MB weights in turn,
default 4: 128 MB, so the L2 is flushed as a layer's weights flush it in a model; 1 fits in an
H100's 50 MB L2, so the site's small buffers can stay there) after each norm, as in a decoder
layer: Inductor then compiles each site and norm into a kernel of its own between GEMMs, as it
does in the engine, instead of fusing the stack together. ``--mlp`` makes each layer what
a Llama-8B decoder layer is around a ``post_block`` site, attention aside: the site steers
the residual tied to the MLP's output ``h`` (as the worker calls it), the residual add and
RMSNorm, then an MLP with the 8B shapes and weights of its own (352 MB a layer, 11 GB in
all), so between two sites as many bytes stream through L2 as in the engine and the site's
small buffers are evicted as they are there. ``--inductor KEY=VALUE ...`` compiles
every variant under those Inductor settings (integers), e.g. its store-or-recompute
thresholds ``realize_reads_threshold`` / ``realize_opcount_threshold``.

Prints microseconds per stack (median of repeated graph replays) and the ratio to ``none``
(median over rounds in which every graph is timed in turn) for 1, 32, 256 and 2048 tokens;
writes ``site_cost.json``.

``--l2-window`` also captures every variant on a stream with an L2 access-policy window
(:mod:`l2_window`) over the index and gate buffer (``variant_l2``),
and writes the windowed graphs at 1 token as DOT (``graph_*.dot``: the kernel nodes' attributes).

Usage: python benchmarks/site_cost.py --out DIR [--variants op fused] [--gemm [N] | --mlp]
       [--tokens 1 32] [--l2-window] [--inductor realize_reads_threshold=16]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

LAYERS = 32
HIDDEN = 4096
STEERED_LAYER = 16
TOKENS = (1, 32, 256, 2048)
VARIANTS = ("none", "op", "gather", "fused", "gate_masked", "index")
INTERMEDIATE = 14336
"""The MLP's width with ``--mlp`` (Llama-8B)."""
TRAFFIC = ("idle", "registered", "gated")


def graph_of(fn, x, h, stream=None, dump=None):
    """``fn(x, h)`` warmed up (compiled, autotuned) and captured as one CUDA graph (on
    ``stream``; its nodes written as DOT to ``dump``)."""
    import torch

    for _ in range(3):
        fn(x, h)
    graph = torch.cuda.CUDAGraph()
    if dump:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph, stream=stream):
        fn(x, h)
    if dump:
        graph.debug_dump(str(dump))
    return graph


def cuda_us(fn, calls: int, timings: int = 30) -> float:
    """Median GPU microseconds per call of ``fn`` (``timings`` timings of ``calls``
    back-to-back calls, by CUDA events)."""
    import torch

    times = []
    for _ in range(timings):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def gate_masked_add(x, h, index, gate_score, table, dyn, *_):
    """The ``gate_masked`` form of a fused site (``steer_add``'s arguments): the dynamic tier's
    row read only where the token's gate is open (session 14, ``a2873e6``; not shipped)."""
    import torch

    from dynsteer.engine_ext.worker import ops

    n = x.shape[0]
    rows = (index[ops.INDEX_ROW, :n] & ops.ROW_MASK).to(torch.long)
    gate = gate_score[ops.GATE, :n]
    x32 = x.to(torch.float32)
    delta = (ops._row_of(table, rows)
             + gate[:, None] * ops._row_of(dyn, torch.where(gate != 0, rows, 0)))
    return (x32 + ops._within_limit(x32, h, delta, x.dtype)).to(x.dtype)


def inductor_settings(pairs: list[str]) -> dict[str, int]:
    """``KEY=VALUE`` arguments as Inductor settings (integers)."""
    return {k: int(v) for k, v in (kv.split("=", 1) for kv in pairs)}


def interleaved_us(fns: dict, calls: int, rounds: int = 30) -> dict[str, list[float]]:
    """GPU microseconds per call of each of ``fns``, timed in turn ``rounds`` times
    (``calls`` back-to-back calls per timing), so that drift in the GPU's clock falls on all
    of them alike: each round's ratio of two is a paired comparison."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(cuda_us(fn, calls, timings=1))
    return times


def replay_us(graph) -> float:
    """Median microseconds per replay (30 timings of 20 back-to-back replays)."""
    return cuda_us(graph.replay, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--gemm", type=int, nargs="?", const=4, default=0, metavar="N",
                        help="a GEMM after each norm, cycling through N weights (default 4)")
    parser.add_argument("--mlp", action="store_true",
                        help="each layer an 8B-shaped MLP with weights of its own, the site "
                             "tied to its output as in the worker")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--l2-window", action="store_true",
                        help="also capture every variant on a stream whose L2 access-policy "
                             "window keeps the index and gate persisting (variant_l2)")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Inductor config (integers) to compile under")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    inductor = inductor_settings(args.inductor)
    variants = ["none", *(v for v in args.variants if v != "none")]
    import torch
    import torch.nn.functional as F

    from dynsteer.engine_ext.worker import ops

    device = torch.device("cuda")
    rows, max_tokens = 65, max(TOKENS)
    zeros = torch.zeros
    small = zeros((ops.INDEX_ROWS + 2) * max_tokens, dtype=torch.int32, device=device)
    index = small[:ops.INDEX_ROWS * max_tokens].view(ops.INDEX_ROWS, max_tokens)
    gate_score = small[ops.INDEX_ROWS * max_tokens:].view(torch.float32).view(2, max_tokens)
    streams = {"": None}
    if args.l2_window:
        import l2_window

        print("persisting L2 set aside:", l2_window.reserve(device, 4 << 20), "bytes")
        streams["_l2"] = torch.cuda.Stream()
        l2_window.set_window(streams["_l2"], small)
    table = zeros(LAYERS, rows, HIDDEN, device=device)
    dyn = zeros(LAYERS, rows, HIDDEN, device=device)
    flags = zeros(LAYERS, rows, dtype=torch.int32, device=device)
    table[STEERED_LAYER, 1] = torch.randn(HIDDEN, device=device) * 0.01
    flags[STEERED_LAYER, 1] = ops.STATIC_FLAG
    shared = {
        "probes": zeros(2, HIDDEN, device=device), "params": zeros(2, 3, device=device),
        "capture": zeros(1, 2, HIDDEN, device=device),
        "site_lane": torch.full((LAYERS,), -1, dtype=torch.int32, device=device),
        "control": zeros(1, ops.CTL_COLS, device=device),
        "proj_dir": zeros(rows, 0, HIDDEN, device=device),
        "proj_par": zeros(rows, 0, ops.PROJ_PARAMS, device=device),
        "proj_gram": zeros(rows, 0, 0, device=device)}
    site_buffers = [ops.SteerBuffers(index=index, gate_score=gate_score, table=table[layer],
                                     dyn=dyn[layer], flags=flags[layer], **shared)
                    for layer in range(LAYERS)]
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
    gemms = [torch.randn(HIDDEN, HIDDEN, dtype=torch.bfloat16, device=device) / HIDDEN**0.5
             for _ in range(args.gemm)]
    mlps = [(torch.randn(HIDDEN, 2 * INTERMEDIATE, dtype=torch.bfloat16, device=device)
             / HIDDEN**0.5,
             torch.randn(INTERMEDIATE, HIDDEN, dtype=torch.bfloat16, device=device)
             / INTERMEDIATE**0.5) for _ in range(LAYERS if args.mlp else 0)]

    def gather_add(x: torch.Tensor, b: ops.SteerBuffers) -> torch.Tensor:
        n = x.shape[0]
        r = (b.index[ops.INDEX_ROW, :n] & ops.ROW_MASK).to(torch.long)
        g = b.gate_score[ops.GATE, :n, None]
        x32 = x.float()
        y = x32 + b.table[r] + g * b.dyn[r]
        y = torch.where(y.abs() <= ops.stream_limit(x.dtype), y, x32)
        return y.to(x.dtype)

    def site(variant: str, x: torch.Tensor, h: torch.Tensor | None,
             layer: int) -> torch.Tensor:
        b = site_buffers[layer]
        if variant == "op":
            return torch.ops.dynsteer.steer(x, h, *b, layer)
        if variant == "fused":
            return ops.steer_add(x, h, b.index, b.gate_score, b.table, b.dyn, b.proj_dir,
                                 b.proj_par, b.proj_gram, ops.site_bit(layer, LAYERS))
        if variant == "gather":
            return gather_add(x, b)
        if variant == "gate_masked":
            return gate_masked_add(x, h, *b)
        if variant == "index":
            entry = b.index[ops.INDEX_ROW, :x.shape[0]]
            return (x.float() + (entry != 0).float()[:, None]).to(x.dtype)
        return x

    def rmsnorm(x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight

    def stack(variant: str):
        def forward(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            for layer in range(LAYERS):
                x = site(variant, x + h, None, layer)
                h = rmsnorm(x)
                if gemms:
                    h = h @ gemms[layer % len(gemms)]
            return x + h

        def decoder(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            for layer in range(LAYERS):
                x = site(variant, x, h, layer) + h
                gate_up = rmsnorm(x) @ mlps[layer][0]
                act = F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]
                h = act @ mlps[layer][1]
            return x + h
        return torch.compile(decoder if mlps else forward, fullgraph=True)

    results: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        h = torch.randn_like(x)
        graphs = {}
        for variant in variants:
            with torch._inductor.config.patch(inductor):
                compiled = stack(variant)
                for suffix, stream in streams.items():
                    dump = (args.out / f"graph_{variant}{suffix}.dot"
                            if suffix and tokens == 1 else None)
                    graphs[variant + suffix] = graph_of(compiled, x, h, stream, dump)
            torch._dynamo.reset()
        for traffic in TRAFFIC:  # the same graphs: only the index they read changes
            # the steered row at every site (every site-group bit set), as the gather reads it
            index[ops.INDEX_ROW] = (ops.row_entry(1, range(LAYERS), LAYERS)
                                    if traffic != "idle" else 0)
            gate_score[ops.GATE] = float(traffic == "gated")
            us = interleaved_us({name: g.replay for name, g in graphs.items()}, 5 if mlps else 20)
            results.setdefault(traffic, {})[str(tokens)] = {
                name: statistics.median(t) for name, t in us.items()}
            ratios.setdefault(traffic, {})[str(tokens)] = {
                name: statistics.median(a / b for a, b in zip(t, us["none"], strict=True))
                for name, t in us.items()}
            print(tokens, traffic, {name: round(r, 4) for name, r in
                                    ratios[traffic][str(tokens)].items()}, flush=True)
    names = list(graphs)
    for traffic, by_tokens in results.items():
        print(f"\n{traffic}\n{'tokens':>7} "
              + " ".join(f"{v + ' us':>12} {'ratio':>7}" for v in names))
        for tokens, row in by_tokens.items():
            paired = ratios[traffic][tokens]
            print(f"{tokens:>7} " + " ".join(f"{row[v]:>12.1f} {paired[v]:>7.4f}"
                                             for v in names))
    (args.out / "site_cost.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "layers": LAYERS, "hidden": HIDDEN,
         "gemm": args.gemm, "mlp": args.mlp, "inductor": inductor, "l2_window": args.l2_window,
         "steered_layer": STEERED_LAYER, "us_per_stack": results,
         "paired_ratio_to_none": ratios}, indent=2))


if __name__ == "__main__":
    main()
