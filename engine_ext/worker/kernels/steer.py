"""``dynsteer::steer`` on CUDA (see :mod:`..ops`): the site kernel.

One program per token. Monitor tokens (rare: only at their monitor site) read the stream once
for the dot product; every token then reads ``x`` once, gathers only the table rows its
``flags`` say are in use, and writes ``out`` once; captured tokens (rare: prompt tokens of
capture requests while their site has a lane) finally read the stream again to store it.
A token that is not captured pays one int load (its capture row) and a branch: nothing that
shows at decode batch sizes, and under a tenth of this kernel's time in long prefills, where
the layer's matmuls take far longer (``benchmarks/kernel_bench.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._tl import (
    DYNAMIC_FLAG,
    GATE,
    INDEX_CAPTURE,
    INDEX_PROBE,
    INDEX_ROW,
    PARAM_SITE,
    PROJ_GATED,
    PROJ_NORM,
    PROJ_PARAMS,
    PROJ_STATIC,
    PROJ_VALUE,
    PROJECT_FLAG,
    ROW_MASK,
    SCORE,
    STATIC_FLAG,
    check_buffers,
    probe_gate,
    stream_block,
    unit_stride,
)

if TYPE_CHECKING:
    from ..buffers import SteerBuffers


@triton.jit
def _steer_kernel(
    x_ptr, h_ptr, out_ptr,
    # SteerBuffers, in its order
    index_ptr, gate_score_ptr, table_ptr, dyn_ptr, flags_ptr, probes_ptr, params_ptr,
    capture_ptr, site_lane_ptr, control_ptr, proj_dir_ptr, proj_par_ptr, proj_gram_ptr,
    site, hidden, x_stride, h_stride, out_stride, index_stride, gate_score_stride,
    params_stride, lane_stride, limit,
    HAS_H: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # The stream's first block, loaded before anything that depends on the index, so that its
    # latency overlaps the index's: a token neither steered nor monitored here then waits on
    # one round trip to memory, not three (``BLOCK`` covers a whole row up to ``MAX_BLOCK``).
    first = tl.arange(0, BLOCK)
    x_first = tl.load(x_ptr + t * x_stride + first, mask=first < hidden,
                      other=0.0).to(tl.float32)
    c = tl.load(index_ptr + INDEX_CAPTURE * index_stride + t)
    row = (tl.load(index_ptr + INDEX_ROW * index_stride + t) & ROW_MASK).to(tl.int64)
    # Row 0 (not steered) and probe 0 (not monitored) read nothing: their loads would be
    # a second dependent round trip for most tokens.
    flags = tl.load(flags_ptr + row, mask=row != 0, other=0)
    p = tl.load(index_ptr + INDEX_PROBE * index_stride + t).to(tl.int64)
    gate_ptr = gate_score_ptr + GATE * gate_score_stride + t
    g = tl.load(gate_ptr)
    param_ptr = params_ptr + p * params_stride
    monitor_site = tl.load(param_ptr + PARAM_SITE, mask=p != 0, other=-1.0).to(tl.int32)
    if (p != 0) & (monitor_site == site):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hidden
            s = stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
            w = tl.load(probes_ptr + p * hidden + offs, mask=mask, other=0.0)
            acc += s * w
        score = tl.sum(acc, axis=0)
        g = probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t)
        tl.store(gate_score_ptr + SCORE * gate_score_stride + t, score)
        tl.store(gate_ptr, g)
    use_static = (flags & STATIC_FLAG) != 0
    use_dynamic = (flags & DYNAMIC_FLAG) != 0
    use_proj = (flags & PROJECT_FLAG) != 0
    # Projection slots (ablate / clamp, norm-matched adds): one pass for the dot products with
    # every slot's direction and the stream's norm, then the slots in order through the Gram
    # matrix (see ops.py). ``deltas`` stays
    # zero for tokens whose row has none, and then no direction is loaded below.
    slot = tl.arange(0, SLOTS_P2)
    deltas = tl.zeros([SLOTS_P2], dtype=tl.float32)
    dir_base = proj_dir_ptr + row * SLOTS * hidden + slot[:, None] * hidden
    if SLOTS > 0:  # noqa: SIM102  (a constexpr test: the block is not traced without slots)
        if use_proj:
            dots = tl.zeros([SLOTS_P2, BLOCK], dtype=tl.float32)
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, hidden, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hidden
                z = stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
                w = tl.load(dir_base + offs[None, :],
                            mask=(slot[:, None] < SLOTS) & mask[None, :], other=0.0)
                dots += w * z[None, :]
                squares += z * z
            s = tl.sum(dots, axis=1)
            norm = tl.sqrt(tl.sum(squares, axis=0))
            par = proj_par_ptr + (row * SLOTS + slot) * PROJ_PARAMS
            inside = slot < SLOTS
            coef = (tl.load(par + PROJ_STATIC, mask=inside, other=0.0)
                    + g * tl.load(par + PROJ_GATED, mask=inside, other=0.0))
            value = tl.load(par + PROJ_VALUE, mask=inside, other=0.0)
            matched = tl.load(par + PROJ_NORM, mask=inside, other=0.0) != 0
            for d in tl.static_range(SLOTS):
                gram = tl.load(proj_gram_ptr + (row * SLOTS + slot) * SLOTS + d,
                               mask=slot < d, other=0.0)
                seen = tl.sum(tl.where(slot == d, s, 0.0)) + tl.sum(deltas * gram)
                delta = tl.sum(tl.where(slot == d,
                                        coef * tl.where(matched, norm, value - seen), 0.0))
                deltas = tl.where(slot == d, delta, deltas)
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + t * x_stride + offs, mask=mask & (start > 0),
                    other=0.0).to(tl.float32)
        x = tl.where(start > 0, x, x_first)
        # A scalar flag selects the block mask (``tl.where``, not ``&``: the same predicate
        # compiled, and the form Triton's CPU interpreter runs, for tests/test_ops.py).
        d = tl.load(table_ptr + row * hidden + offs, mask=tl.where(use_static, mask, False),
                    other=0.0)
        dd = tl.load(dyn_ptr + row * hidden + offs, mask=tl.where(use_dynamic, mask, False),
                     other=0.0)
        out = x + d + g * dd
        if SLOTS > 0:
            w = tl.load(dir_base + offs[None, :],
                        mask=tl.where(use_proj, (slot[:, None] < SLOTS) & mask[None, :], False),
                        other=0.0)
            out += tl.sum(deltas[:, None] * w, axis=0)
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
                v = stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
                tl.store(capture_ptr + base + offs, v, mask=mask)


MAX_BLOCK = 4096
"""The longest stream block of ``_steer_kernel``: one block holds a row of hidden size up to
this (one pass, no loop, at batch 1 where the kernel's time is its load latency)."""


def _block_for(hidden: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(hidden))


def steer_triton(x: torch.Tensor, h: torch.Tensor | None, b: SteerBuffers, site: int,
                 limit: float) -> torch.Tensor:
    """CUDA implementation of ``dynsteer::steer``: reads the first ``x.shape[0]`` columns of
    ``index`` and ``gate_score`` (row strides are passed; element strides must be 1)."""
    x, h = unit_stride(x), None if h is None else unit_stride(h)
    check_buffers(b)
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    block = _block_for(hidden)
    hh = h if h is not None else x
    slots = b.proj_dir.shape[1]
    if slots:  # the [slots, block] tile of directions shares the block's registers
        block = min(block, max(256, 2048 // triton.next_power_of_2(slots)))
    _steer_kernel[(tokens,)](
        x, hh, out, *b, site, hidden, x.stride(0), hh.stride(0), out.stride(0),
        b.index.stride(0), b.gate_score.stride(0), b.params.stride(0), b.capture.stride(0),
        limit, HAS_H=h is not None, BLOCK=block, SLOTS=slots,
        SLOTS_P2=max(1, triton.next_power_of_2(slots)), num_warps=max(4, block // 256),
    )
    return out
