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

Usage: python benchmarks/kernel_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _time_ms(fn, reps: int) -> float:
    import torch

    for _ in range(3):
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
    import torch

    from dynsteer.engine_ext.worker.ops import (
        CTL_COLS,
        INDEX_CAPTURE,
        INDEX_PROBE,
        INDEX_ROW,
        INDEX_ROWS,
        SteerBuffers,
        stream_limit,
    )
    from dynsteer.engine_ext.worker.triton_kernels import steer_triton

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
    )
    limit = stream_limit(x.dtype)

    def run() -> Any:
        return steer_triton(x, h, buffers, 0, limit)

    eager_ms = _time_ms(run, 50)
    graph_us = _graph_time_us(run, launches=200 if tokens <= 256 else 20)
    moved = MODES[mode] * tokens * hidden * 2
    return {"tokens": tokens, "hidden": hidden, "mode": mode, "eager_call_us": eager_ms * 1000,
            "graph_launch_us": graph_us, "bytes_per_s": moved / (graph_us / 1e6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    import torch

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
