"""Microbenchmark of the fused ``dynsteer::steer`` Triton kernel (GPU).

For tokens in {1, 32, 256, 4096, 16384} x hidden in {2048, 4096, 8192} (bf16), three modes:
``gated``: every token steered (static + gated row) and monitored at this site (x and h read
for the monitor, x read again, out written: 4 x T x H x 2 bytes, table reads not counted);
``idle``: all tokens on row 0, no probe, no capture (normal traffic: x read, out written);
``capture``: every token captured at this site, not steered (x and h read, the fp32 capture
row written, x read again, out written: 6 x T x H x 2 bytes). Reported: achieved bytes/s as a
fraction of the measured device-to-device copy bandwidth (read + write of the same bytes), and
the per-launch time. Kernel time is measured by replaying a CUDA graph of many launches (as
vLLM runs it), so the ~40 us Python launch path of an eager call is not counted; the eager
time of one call is reported beside it.

``--against FILE...`` compares the kernel with other versions of
``engine_ext/worker/kernels/steer.py`` (e.g. ``git show
HEAD~1:engine_ext/worker/kernels/steer.py > old.py``; with ``--norm``, of
``kernels/steer_norm.py``; each named by its file) in one process: all run in turn over rounds
(graph replays), idle and gated, at 1, 32 and 256 tokens of hidden size 4096, once *hot* (launch
after launch, the op's buffers in L2) and once *cold* (each launch after a write of 128 MB, as a
site in a decoder layer runs after its layer's weights streamed through L2; the write alone is
timed and subtracted), and the per-launch times and their paired ratio to the first file's are
printed and written.

``--norm`` times the site and the RMSNorm after it as one kernel (``steer_norm_triton``, the
``fused_norms`` form) the same way, against the stock fused add + RMSNorm as Inductor compiles
it (and, with ``--against``, that file's ``steer_norm_triton``): the kernel that replaces a
norm of the decoder layer, against the one it replaces.

Usage: python benchmarks/kernel_bench.py --out DIR [--against TRITON_KERNELS.py...] [--norm]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any


def _time_ms(fn, reps: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_time_us(fn, launches: int = 200) -> float:
    """Per-launch time of ``fn`` captured ``launches`` times in one CUDA graph."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _time_ms(graph.replay, 20) * 1000 / launches


def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 2 / (ms / 1000)


MODES = {"gated": 4, "idle": 2, "capture": 6}
"""Mode -> bytes moved per element of x, in units of 2 bytes (bf16)."""


def case(tokens: int, hidden: int, mode: str) -> dict[str, Any]:
    from dynsteer.engine_ext.worker.kernels.steer import steer_triton

    run = steer_call(steer_triton, tokens, hidden, mode)
    eager_ms = _time_ms(run, 50)
    graph_us = _graph_time_us(run, launches=200 if tokens <= 256 else 20)
    moved = MODES[mode] * tokens * hidden * 2
    return {"tokens": tokens, "hidden": hidden, "mode": mode, "eager_call_us": eager_ms * 1000,
            "graph_launch_us": graph_us, "bytes_per_s": moved / (graph_us / 1e6)}


def steer_call(steer_triton, tokens: int, hidden: int, mode: str):
    """A call of ``steer_triton`` on fresh buffers of ``mode``'s traffic."""
    x, h, buffers, limit = steer_inputs(tokens, hidden, mode)
    return lambda: steer_triton(x, h, buffers, 0, limit)


def steer_inputs(tokens: int, hidden: int, mode: str) -> tuple[Any, Any, Any, float]:
    """``(x, h, buffers, limit)`` of ``mode``'s traffic, fresh, on the GPU."""
    import torch

    from dynsteer.engine_ext.worker.layout import (
        CTL_COLS,
        INDEX_CAPTURE,
        INDEX_PROBE,
        INDEX_ROW,
        INDEX_ROWS,
        PROJ_PARAMS,
    )
    from dynsteer.engine_ext.worker.ops import SteerBuffers, stream_limit
    steered = mode == "gated"
    captured = mode == "capture"
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn_like(x)
    index = torch.zeros(INDEX_ROWS, tokens, dtype=torch.int32, device="cuda")
    index[INDEX_ROW] = int(steered)
    index[INDEX_PROBE] = int(steered)
    if captured:
        index[INDEX_CAPTURE] = torch.arange(1, tokens + 1, dtype=torch.int32, device="cuda")
    buffers = SteerBuffers(
        index=index,
        gate_score=torch.zeros(2, tokens, device="cuda"),
        table=torch.randn(3, hidden, device="cuda"),
        dyn=torch.randn(3, hidden, device="cuda"),
        flags=torch.tensor([0, 3, 3], dtype=torch.int32, device="cuda"),
        probes=torch.randn(2, hidden, device="cuda"),
        params=torch.tensor([[0, 0, 0], [0.0, 1.0, 0.0]], device="cuda"),
        capture=torch.zeros(1, tokens + 1 if captured else 1, hidden, device="cuda"),
        site_lane=torch.tensor([0 if captured else -1], dtype=torch.int32, device="cuda"),
        control=torch.zeros(1, CTL_COLS, device="cuda"),
        proj_dir=torch.zeros(3, 0, hidden, device="cuda"),
        proj_par=torch.zeros(3, 0, PROJ_PARAMS, device="cuda"),
        proj_gram=torch.zeros(3, 0, 0, device="cuda"),
    )
    return x, h, buffers, stream_limit(x.dtype)


def load_kernels(path: Path):
    """Another version of a kernel module (``kernels/steer.py`` or ``kernels/steer_norm.py``) as
    a module of its own (its relative imports made absolute; Triton reads a kernel's source from
    its file, so it is imported from one)."""
    import importlib.util
    import re
    import tempfile

    packages = {1: "dynsteer.engine_ext.worker.kernels", 2: "dynsteer.engine_ext.worker",
                3: "dynsteer.engine_ext"}
    source = re.sub(r"^(\s*)from (\.+)(\w*)",
                    lambda m: f"{m[1]}from {packages[len(m[2])]}{'.' if m[3] else ''}{m[3]}",
                    path.read_text(), flags=re.M)
    copy = Path(tempfile.mkdtemp()) / "kernels_against.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location("kernels_against", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def norm_call(steer_norm_triton, tokens: int, hidden: int, mode: str):
    """A call of ``steer_norm_triton`` (the site and the RMSNorm after it) on the buffers of
    :func:`steer_inputs`, with an RMSNorm weight; idle: the kernel of a site without monitor
    (most sites), gated: of a monitor site."""
    import torch

    x, h, buffers, limit = steer_inputs(tokens, hidden, mode)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    return lambda: steer_norm_triton(x, h, buffers, 0, limit, weight, 1e-5, mode != "idle")


def inductor_norm_call(tokens: int, hidden: int, mode: str):
    """Stock vLLM's fused add + RMSNorm (its native math, :func:`ops.rms_norm_after`), compiled
    by Inductor for this shape: what a site's norm kernel is measured against."""
    import torch

    from dynsteer.engine_ext.worker.ops import rms_norm_after

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(rms_norm_after, dynamic=False)
    return lambda: compiled(residual, x, weight, 1e-5)


def compare(contenders: dict[str, Any], out: Path, rounds: int = 15,
            launches: int = 50) -> None:
    """``--against`` / ``--norm``: see the module docstring. ``contenders`` maps a name to
    ``make(tokens, mode) -> fn``; every time is also given as a paired ratio to the first."""
    import torch

    flush = torch.empty(64 * 1024**2, dtype=torch.float16, device="cuda")

    def graph(fns) -> Any:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                for fn in fns:
                    fn()
        return g

    flush_graph = graph([flush.zero_])
    flush_graph.replay()
    names = list(contenders)
    rows = []
    print(f"{'tokens':>6} {'mode':<6} {'L2':<4} " + " ".join(f"{n + ' us':>14}" for n in names)
          + " " + " ".join(f"{n + '/' + names[0]:>18}" for n in names[1:]))
    for tokens in (1, 32, 256):
        for mode in ("idle", "gated"):
            calls = {name: make(tokens, mode) for name, make in contenders.items()}
            for cache in ("hot", "cold"):
                graphs = {name: graph([fn] if cache == "hot" else [flush.zero_, fn])
                          for name, fn in calls.items()}
                for g in graphs.values():
                    g.replay()
                times: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(rounds):
                    base = _time_ms(flush_graph.replay, 1, 0) if cache == "cold" else 0.0
                    for name, g in graphs.items():
                        times[name].append((_time_ms(g.replay, 1, 0) - base) * 1000 / launches)
                row: dict[str, Any] = {"tokens": tokens, "mode": mode, "cache": cache}
                for name in names:
                    row[f"{name}_us"] = statistics.median(times[name])
                for name in names[1:]:
                    row[f"{name}_over_{names[0]}"] = statistics.median(
                        a / b for a, b in zip(times[name], times[names[0]], strict=True))
                rows.append(row)
                print(f"{tokens:>6} {mode:<6} {cache:<4} "
                      + " ".join(f"{row[n + '_us']:>14.2f}" for n in names) + " "
                      + " ".join(f"{row[n + '_over_' + names[0]]:>18.3f}" for n in names[1:]),
                      flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_ab.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "contenders": names, "hidden": 4096,
         "launches_per_graph": launches, "rounds": rounds, "rows": rows}, indent=2))


def _norm_contender(kernel, tokens: int, mode: str):
    return norm_call(kernel, tokens, 4096, mode)


def _steer_contender(kernel, tokens: int, mode: str):
    return steer_call(kernel, tokens, 4096, mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--against", type=Path, nargs="+", default=[],
                    help="other versions of kernels/steer.py (with --norm: "
                         "kernels/steer_norm.py) to compare with (named by file)")
    ap.add_argument("--norm", action="store_true",
                    help="time the site + RMSNorm kernel against Inductor's stock norm")
    args = ap.parse_args()
    import torch

    from dynsteer.engine_ext.worker.kernels import steer, steer_norm

    others = {path.stem: load_kernels(path) for path in args.against}
    if args.norm:
        contenders = {"inductor": lambda t, m: inductor_norm_call(t, 4096, m)}
        for name, kernels in {"new": steer_norm, **others}.items():
            contenders[name] = partial(_norm_contender, kernels.steer_norm_triton)
        compare(contenders, args.out)
        return
    if others:
        contenders = {name: partial(_steer_contender, kernels.steer_triton)
                      for name, kernels in others.items()}
        contenders["new"] = partial(_steer_contender, steer.steer_triton)
        compare(contenders, args.out)
        return
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "cases": []}
    print(f"device {results['device']}, copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    print(f"{'tokens':>6} {'hidden':>6} {'mode':<7} {'us/launch':>10} {'TB/s':>6} "
          f"{'of copy':>8} {'eager us':>9}")
    for tokens in (1, 32, 256, 4096, 16384):
        for hidden in (2048, 4096, 8192):
            for mode in MODES:
                r = case(tokens, hidden, mode)
                r["fraction_of_copy"] = r["bytes_per_s"] / bw
                results["cases"].append(r)
                print(f"{tokens:>6} {hidden:>6} {mode:<7} "
                      f"{r['graph_launch_us']:>10.2f} {r['bytes_per_s'] / 1e12:>6.2f} "
                      f"{r['fraction_of_copy']:>8.1%} {r['eager_call_us']:>9.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
