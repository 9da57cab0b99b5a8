"""``dynsteer::steer_norm`` on CUDA (see :func:`..ops.steer_norm`): a site and the fused
add + RMSNorm after it, one program per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .. import layout
from ._tl import (
    GATE,
    INDEX_CAPTURE,
    INDEX_PROBE,
    INDEX_ROW,
    PARAM_SITE,
    ROW_MASK,
    SCORE,
    check_buffers,
    probe_gate,
    unit_stride,
)

if TYPE_CHECKING:
    from ..buffers import SteerBuffers


@triton.jit
def _steer_norm_kernel(
    x_ptr, h_ptr, out_ptr, stream_ptr, weight_ptr,
    index_ptr, gate_score_ptr, table_ptr, dyn_ptr, probes_ptr, params_ptr, capture_ptr,
    site_lane_ptr, control_ptr,
    site, site_bit, hidden, x_stride, h_stride, out_stride, stream_stride, index_stride,
    gate_score_stride, params_stride, lane_stride, limit, eps,
    BLOCK: tl.constexpr, MONITOR: tl.constexpr,
):
    """``dynsteer::steer_norm``: the site (as ``_steer_kernel``, without projection slots),
    then vLLM's fused add + RMSNorm of ``(h, steered x)``, one program per token, the row in
    one block.

    Nothing waits on the token's index until the unsteered stream's sum of squares is done:
    every load is issued first, the stream before steering (what the monitor and capture
    read, and for an unsteered token what the norm normalizes) is summed, and only then does
    a token whose entry steers this site read its rows (both tiers: a row's unused tier is
    zero) and sum again. A token that is neither steered nor monitored here thus costs the
    norm's own loads plus two 4-byte loads in their shadow. The order matters: with the rows
    read (masked) before the sum, an idle site waits on them too, which shows when its layer's
    weights have flushed L2 (``benchmarks/kernel_bench.py --norm``)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + t * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    entry = tl.load(index_ptr + INDEX_ROW * index_stride + t)
    gate_ptr = gate_score_ptr + GATE * gate_score_stride + t
    g = tl.load(gate_ptr)
    if MONITOR:
        c = tl.load(index_ptr + INDEX_CAPTURE * index_stride + t)
        p = tl.load(index_ptr + INDEX_PROBE * index_stride + t).to(tl.int64)
    s = x + h
    sum_sq = tl.sum(s * s, axis=0)
    if MONITOR:
        param_ptr = params_ptr + p * params_stride
        monitor_site = tl.load(param_ptr + PARAM_SITE, mask=p != 0, other=-1.0).to(tl.int32)
        if (p != 0) & (monitor_site == site):
            probe = tl.load(probes_ptr + p * hidden + offs, mask=mask, other=0.0)
            score = tl.sum(s * probe, axis=0)
            g = probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t)
            tl.store(gate_score_ptr + SCORE * gate_score_stride + t, score)
            tl.store(gate_ptr, g)
    row = (entry & ROW_MASK).to(tl.int64)
    stream = s
    if (row != 0) & ((site_bit == 0) | ((entry & site_bit) != 0)):
        d = tl.load(table_ptr + row * hidden + offs, mask=mask, other=0.0)
        dd = tl.load(dyn_ptr + row * hidden + offs, mask=mask, other=0.0)
        y = x + d + g * dd
        # Never a NaN, inf or overflowing steered value (see ops.py); NaN fails <=. The
        # steered x is rounded to its dtype, as the unfused site hands it to the norm.
        y = tl.where(tl.abs(y) <= limit, y, x)
        stream = y.to(stream_ptr.dtype.element_ty).to(tl.float32) + h
        sum_sq = tl.sum(stream * stream, axis=0)
    tl.store(stream_ptr + t * stream_stride + offs, stream.to(stream_ptr.dtype.element_ty),
             mask=mask)
    n = stream * tl.rsqrt(sum_sq / hidden + eps)
    # ``n.to(weight dtype) * weight`` in the weight's dtype: an fp32 product of two bf16
    # values is exact, so rounding it once is the bf16 product.
    wdt = weight_ptr.dtype.element_ty
    n = (n.to(wdt).to(tl.float32) * weight.to(tl.float32)).to(wdt)
    tl.store(out_ptr + t * out_stride + offs, n.to(out_ptr.dtype.element_ty), mask=mask)
    if MONITOR:  # noqa: SIM102  (a constexpr test: not traced for a site nothing captures)
        if c != 0:
            lane = tl.load(site_lane_ptr + site)
            if lane >= 0:
                base = lane.to(tl.int64) * lane_stride + c.to(tl.int64) * hidden
                tl.store(capture_ptr + base + offs, s, mask=mask)


def steer_norm_triton(x: torch.Tensor, h: torch.Tensor, b: SteerBuffers, site: int,
                      limit: float, weight: torch.Tensor, eps: float, monitor: bool = True,
                      site_bit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA implementation of ``dynsteer::steer_norm``: the site, then the fused add +
    RMSNorm, in one program per token; the engine has no projection slots (checked by the
    caller) and ``hidden <= layout.MAX_NORM_ROW``. ``monitor`` False compiles out the probe and
    capture code, for a site where neither ever happens; ``site_bit`` (0: none) is the site's
    group bit, without which a token's entry steers nothing here."""
    x, h = unit_stride(x), unit_stride(h)
    check_buffers(b)
    tokens, hidden = x.shape
    if b.proj_dir.shape[1] or hidden > layout.MAX_NORM_ROW:
        raise ValueError(f"dynsteer::steer_norm: {b.proj_dir.shape[1]} projection slots, "
                         f"hidden {hidden} (needs none and at most {layout.MAX_NORM_ROW})")
    normed, stream = torch.empty_like(x), torch.empty_like(x)
    if tokens == 0:
        return normed, stream
    block = triton.next_power_of_2(hidden)
    _steer_norm_kernel[(tokens,)](
        x, h, normed, stream, weight.contiguous(), b.index, b.gate_score, b.table, b.dyn,
        b.probes, b.params, b.capture, b.site_lane, b.control, site, site_bit, hidden,
        x.stride(0), h.stride(0), normed.stride(0), stream.stride(0), b.index.stride(0),
        b.gate_score.stride(0), b.params.stride(0), b.capture.stride(0), limit, eps,
        BLOCK=block, MONITOR=monitor, num_warps=min(32, max(4, block // 256)),
    )
    return normed, stream
