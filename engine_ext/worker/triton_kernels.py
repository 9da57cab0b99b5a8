"""Triton kernel of ``dynsteer::steer`` (see :mod:`.ops`). Imported only for CUDA tensors.

One program per token. Monitor tokens (rare: only at their monitor site) read the stream once
for the dot product; every token then reads ``x`` once, gathers only the table rows its
``flags`` say are in use, and writes ``out`` once; captured tokens (rare: prompt tokens of
capture requests while their site has a lane) finally read the stream again to store it.
A token that is not captured pays one int load (its capture row) and a branch. Seen on an
H200 (bf16, H=4096, graph replay, nothing captured): no measurable cost at 1-256 tokens, +8%
of this kernel's time at 4096-16384 tokens (2-6 us per site, against milliseconds of matmuls
per layer at that size); about half of it is the extra load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _steer_kernel(
    x_ptr, h_ptr, out_ptr, rows_ptr, prow_ptr, table_ptr, dyn_ptr, flags_ptr, probes_ptr,
    params_ptr, gate_ptr, score_ptr, crow_ptr, capture_ptr, site_lane_ptr, site, hidden,
    x_stride, h_stride, out_stride, lane_stride, limit,
    HAS_H: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.load(crow_ptr + t)
    row = tl.load(rows_ptr + t).to(tl.int64)
    flags = tl.load(flags_ptr + row)
    p = tl.load(prow_ptr + t).to(tl.int64)
    g = tl.load(gate_ptr + t)
    monitor_site = tl.load(params_ptr + p * 3 + 2).to(tl.int32)
    if (p != 0) & (monitor_site == site):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hidden
            s = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_H:
                s += tl.load(h_ptr + t * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(probes_ptr + p * hidden + offs, mask=mask, other=0.0)
            acc += s * w
        score = tl.sum(acc, axis=0)
        threshold = tl.load(params_ptr + p * 3)
        sharpness = tl.load(params_ptr + p * 3 + 1)
        z = sharpness * (score - threshold)
        g = 1.0 / (1.0 + tl.exp(-z))
        g = tl.where(g == g, g, 0.0)  # a NaN stream or score must not gate anything
        tl.store(score_ptr + t, score)
        tl.store(gate_ptr + t, g)
    use_static = (flags & 1) != 0
    use_dynamic = (flags & 2) != 0
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(table_ptr + row * hidden + offs, mask=mask & use_static, other=0.0)
        dd = tl.load(dyn_ptr + row * hidden + offs, mask=mask & use_dynamic, other=0.0)
        out = x + d + g * dd
        # Never write NaN, inf or an overflowing steered value (see ops.py); NaN fails <=.
        out = tl.where(tl.abs(out) <= limit, out, x)
        tl.store(out_ptr + t * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    # Last, so the branch delays none of the loads above; x is intact (``out`` is never ``x``).
    # Only captured tokens read the lane table.
    if c != 0:
        lane = tl.load(site_lane_ptr + site)
        if lane >= 0:
            base = lane.to(tl.int64) * lane_stride + c.to(tl.int64) * hidden
            for start in range(0, hidden, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hidden
                v = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_H:
                    v += tl.load(h_ptr + t * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(capture_ptr + base + offs, v, mask=mask)

def _block_for(hidden: int) -> int:
    return min(2048, triton.next_power_of_2(hidden))


def steer_triton(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score,
                 capture_rows, capture, site_lane, site: int, limit: float) -> torch.Tensor:
    """CUDA implementation of ``dynsteer::steer`` (``capture``: contiguous float32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if h is not None and h.stride(-1) != 1:
        h = h.contiguous()
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    block = _block_for(hidden)
    _steer_kernel[(tokens,)](
        x, h if h is not None else x, out, rows, probe_rows, table, dyn, flags, probes, params,
        gate, score, capture_rows, capture, site_lane, site, hidden, x.stride(0),
        (h if h is not None else x).stride(0), out.stride(0), capture.stride(0), limit,
        HAS_H=h is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )
    return out
