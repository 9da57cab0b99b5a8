"""Triton kernels of ``dynsteer::steer`` and ``dynsteer::steer_norm`` (see :mod:`.ops`), and
the small ones around the step (controllers, gate statistics, the index fill). Imported only
for CUDA tensors. What follows is about ``_steer_kernel``; ``_steer_norm_kernel`` says why it
orders its loads as it does.

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

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..prefix_guard.guard import DYNAMIC_EPSILON
from . import gate_stats, ops, token_rows

# The layout constants of ops.py, as globals a jitted function may read.
STATIC_FLAG = tl.constexpr(ops.STATIC_FLAG)
DYNAMIC_FLAG = tl.constexpr(ops.DYNAMIC_FLAG)
PROJECT_FLAG = tl.constexpr(ops.PROJECT_FLAG)
PROJ_STATIC = tl.constexpr(ops.PROJ_STATIC)
PROJ_GATED = tl.constexpr(ops.PROJ_GATED)
PROJ_VALUE = tl.constexpr(ops.PROJ_VALUE)
PROJ_PARAMS = tl.constexpr(ops.PROJ_PARAMS)
PARAM_THRESHOLD = tl.constexpr(ops.PARAM_THRESHOLD)
PARAM_SHARPNESS = tl.constexpr(ops.PARAM_SHARPNESS)
PARAM_SITE = tl.constexpr(ops.PARAM_SITE)
INDEX_ROW = tl.constexpr(ops.INDEX_ROW)
ROW_MASK = tl.constexpr(ops.ROW_MASK)
INDEX_PROBE = tl.constexpr(ops.INDEX_PROBE)
INDEX_CAPTURE = tl.constexpr(ops.INDEX_CAPTURE)
INDEX_CONTROL = tl.constexpr(ops.INDEX_CONTROL)
INDEX_SLOT = tl.constexpr(ops.INDEX_SLOT)
INDEX_POS = tl.constexpr(ops.INDEX_POS)
CTL_KIND = tl.constexpr(ops.CTL_KIND)
CTL_FLOOR = tl.constexpr(ops.CTL_FLOOR)
CTL_SCALE = tl.constexpr(ops.CTL_SCALE)
CTL_COUNT = tl.constexpr(ops.CTL_COUNT)
CTL_P0 = tl.constexpr(ops.CTL_P0)
CTL_P1 = tl.constexpr(ops.CTL_P1)
CTL_P2 = tl.constexpr(ops.CTL_P2)
CTL_COLS = tl.constexpr(ops.CTL_COLS)
KIND_LATCH = tl.constexpr(ops.KIND_LATCH)
KIND_HYSTERESIS = tl.constexpr(ops.KIND_HYSTERESIS)
KIND_PROPORTIONAL = tl.constexpr(ops.KIND_PROPORTIONAL)
KIND_BUDGET = tl.constexpr(ops.KIND_BUDGET)
ST_FIRST_DYNAMIC = tl.constexpr(gate_stats.FIRST_DYNAMIC)
ST_UPTO = tl.constexpr(gate_stats.UPTO)
ST_MONITORED = tl.constexpr(gate_stats.MONITORED)
ST_GATED_PREFILL = tl.constexpr(gate_stats.GATED_PREFILL)
ST_GATED_DECODE = tl.constexpr(gate_stats.GATED_DECODE)
ST_FIRST_DECODE_GATED = tl.constexpr(gate_stats.FIRST_DECODE_GATED)
ST_MAX_SCORE = tl.constexpr(gate_stats.MAX_SCORE)
OPS_HEAD = tl.constexpr(gate_stats.OPS_HEAD)
ST_START = tl.constexpr(gate_stats.START)
ST_NEXT = tl.constexpr(gate_stats.NEXT)
POS_ABSOLUTE = tl.constexpr(ops.POS_ABSOLUTE)
ST_FRONTIER = tl.constexpr(gate_stats.FRONTIER)
ST_PROMPT_LEN = tl.constexpr(gate_stats.PROMPT_LEN)
ST_DYNAMIC_FROM = tl.constexpr(gate_stats.DYNAMIC_FROM)
ST_SITE = tl.constexpr(gate_stats.SITE)
GATE = tl.constexpr(ops.GATE)
SCORE = tl.constexpr(ops.SCORE)
INDEX_ROWS = tl.constexpr(ops.INDEX_ROWS)
SLOT_PREFILL = tl.constexpr(token_rows.SLOT_PREFILL)
SLOT_DECODE = tl.constexpr(token_rows.SLOT_DECODE)
SLOT_PROBE = tl.constexpr(token_rows.SLOT_PROBE)
SLOT_PROMPT_LEN = tl.constexpr(token_rows.SLOT_PROMPT_LEN)


@triton.jit
def _stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H: tl.constexpr):
    """The site's stream at ``offs`` of token ``t`` in float32: ``x``, plus ``h`` where the
    site reads the residual stream as two halves (``HAS_H``)."""
    s = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_H:
        s += tl.load(h_ptr + t * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t):
    """The gate of token ``t`` whose probe (parameters at ``param_ptr``) scored ``score``,
    through the token's controller row if it has one (see ops.py)."""
    threshold = tl.load(param_ptr + PARAM_THRESHOLD)
    sharpness = tl.load(param_ptr + PARAM_SHARPNESS)
    z = sharpness * (score - threshold)
    g = 1.0 / (1.0 + tl.exp(-z))
    g = tl.where(g == g, g, 0.0)  # a NaN stream or score must not gate anything
    k = tl.load(index_ptr + INDEX_CONTROL * index_stride + t).to(tl.int64)
    if (k != 0) & (z == z):
        floor = tl.load(control_ptr + k * CTL_COLS + CTL_FLOOR)
        g = tl.maximum(g, floor) * tl.load(control_ptr + k * CTL_COLS + CTL_SCALE)
    return g


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
            s = _stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
            w = tl.load(probes_ptr + p * hidden + offs, mask=mask, other=0.0)
            acc += s * w
        score = tl.sum(acc, axis=0)
        g = _probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t)
        tl.store(gate_score_ptr + SCORE * gate_score_stride + t, score)
        tl.store(gate_ptr, g)
    use_static = (flags & STATIC_FLAG) != 0
    use_dynamic = (flags & DYNAMIC_FLAG) != 0
    use_proj = (flags & PROJECT_FLAG) != 0
    # Projection slots (ablate / clamp): one pass for the dot products with every slot's
    # direction, then the slots in order through the Gram matrix (see ops.py). ``deltas`` stays
    # zero for tokens whose row has none, and then no direction is loaded below.
    slot = tl.arange(0, SLOTS_P2)
    deltas = tl.zeros([SLOTS_P2], dtype=tl.float32)
    dir_base = proj_dir_ptr + row * SLOTS * hidden + slot[:, None] * hidden
    if SLOTS > 0:  # noqa: SIM102  (a constexpr test: the block is not traced without slots)
        if use_proj:
            dots = tl.zeros([SLOTS_P2, BLOCK], dtype=tl.float32)
            for start in range(0, hidden, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < hidden
                z = _stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
                w = tl.load(dir_base + offs[None, :],
                            mask=(slot[:, None] < SLOTS) & mask[None, :], other=0.0)
                dots += w * z[None, :]
            s = tl.sum(dots, axis=1)
            par = proj_par_ptr + (row * SLOTS + slot) * PROJ_PARAMS
            inside = slot < SLOTS
            coef = (tl.load(par + PROJ_STATIC, mask=inside, other=0.0)
                    + g * tl.load(par + PROJ_GATED, mask=inside, other=0.0))
            value = tl.load(par + PROJ_VALUE, mask=inside, other=0.0)
            for d in tl.static_range(SLOTS):
                gram = tl.load(proj_gram_ptr + (row * SLOTS + slot) * SLOTS + d,
                               mask=slot < d, other=0.0)
                seen = tl.sum(tl.where(slot == d, s, 0.0)) + tl.sum(deltas * gram)
                delta = tl.sum(tl.where(slot == d, coef * (value - seen), 0.0))
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
                v = _stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H)
                tl.store(capture_ptr + base + offs, v, mask=mask)


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
    norm's own loads plus two 4-byte loads in their shadow; the order matters: with the rows
    read (masked) before the sum, an idle site took 0.5 us more per launch after an L2 flush
    (``benchmarks/kernel_bench.py --norm``, H200)."""
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
            g = _probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t)
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


ACC_COLS = 4
"""Columns of the fold's scratch ``acc[K, ACC_COLS]`` (int32): the step's counted tokens of a
row, and the indices of its last token, last token above ``P0``, last token below ``P1``
(-1: none). :func:`new_fold_scratch` makes it; the second kernel resets what it read."""
ACC_COUNT = tl.constexpr(0)
ACC_LAST = tl.constexpr(1)
ACC_LAST_ON = tl.constexpr(2)
ACC_LAST_OFF = tl.constexpr(3)
ACC_STRIDE = tl.constexpr(ACC_COLS)


@triton.jit
def _fold_gather_kernel(index_ptr, gate_score_ptr, control_ptr, acc_ptr, width, index_stride,
                        gate_score_stride, BLOCK: tl.constexpr):
    """One program per block of token columns: each controlled token adds itself to its
    row's counters with atomics (order-free: maxima of token indices, sums)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < width
    k = tl.load(index_ptr + INDEX_CONTROL * index_stride + offs, mask=inside, other=0)
    k = k.to(tl.int64)
    mine = inside & (k != 0)
    base = control_ptr + k * CTL_COLS
    kind = tl.load(base + CTL_KIND, mask=mine, other=0.0).to(tl.int32)
    mine = mine & (kind != 0)
    p0 = tl.load(base + CTL_P0, mask=mine, other=0.0)
    p1 = tl.load(base + CTL_P1, mask=mine, other=0.0)
    g = tl.load(gate_score_ptr + GATE * gate_score_stride + offs, mask=mine, other=0.0)
    s = tl.load(gate_score_ptr + SCORE * gate_score_stride + offs, mask=mine, other=0.0)
    hit = tl.where((kind == KIND_LATCH) & (p1 == p1), s > p1, g > 0.5)
    acc = acc_ptr + k * ACC_STRIDE
    tl.atomic_add(acc + ACC_COUNT, hit.to(tl.int32), mask=mine & hit)
    tl.atomic_max(acc + ACC_LAST, offs, mask=mine)
    tl.atomic_max(acc + ACC_LAST_ON, offs, mask=mine & (s > p0))
    tl.atomic_max(acc + ACC_LAST_OFF, offs, mask=mine & (s < p1))


@triton.jit
def _fold_apply_kernel(gate_score_ptr, control_ptr, acc_ptr, gate_score_stride):
    """One program per control row: the step's counters become the row's new state (see
    :func:`.ops.control_step_torch`, the reference it must equal); the counters are reset."""
    k = tl.program_id(0) + 1
    base = control_ptr + k * CTL_COLS
    acc = acc_ptr + k * ACC_STRIDE
    last = tl.load(acc + ACC_LAST)
    if last >= 0:
        kind = tl.load(base + CTL_KIND).to(tl.int32)
        p0 = tl.load(base + CTL_P0)
        count = tl.load(base + CTL_COUNT) + tl.load(acc + ACC_COUNT).to(tl.float32)
        if kind == KIND_LATCH:
            tl.store(base + CTL_COUNT, count)
            if count >= p0:
                tl.store(base + CTL_FLOOR, 1.0)
        elif kind == KIND_HYSTERESIS:
            on = tl.load(acc + ACC_LAST_ON)
            off = tl.load(acc + ACC_LAST_OFF)
            if on > off:
                tl.store(base + CTL_SCALE, 1.0)
            elif off > on:
                tl.store(base + CTL_SCALE, 0.0)
        elif kind == KIND_PROPORTIONAL:
            s_last = tl.load(gate_score_ptr + SCORE * gate_score_stride + last)
            if s_last == s_last:
                target = tl.minimum(s_last - tl.load(base + CTL_P1), tl.load(base + CTL_P2))
                tl.store(base + CTL_SCALE, p0 * tl.maximum(target, 0.0))
        elif kind == KIND_BUDGET:
            tl.store(base + CTL_COUNT, count)
            if count >= p0:
                tl.store(base + CTL_SCALE, 0.0)
        tl.store(acc + ACC_COUNT, 0)
        tl.store(acc + ACC_LAST, -1)
        tl.store(acc + ACC_LAST_ON, -1)
        tl.store(acc + ACC_LAST_OFF, -1)


def new_fold_scratch(control: torch.Tensor) -> torch.Tensor:
    """The fold's counters for ``control``'s rows, in their reset state."""
    acc = torch.full((control.shape[0], ACC_COLS), -1, dtype=torch.int32, device=control.device)
    acc[:, 0] = 0  # ACC_COUNT
    return acc


FOLD_BLOCK = 256
INDEX_BLOCK = 128
"""Tokens per loop iteration of the index fill (a decode request has one)."""
INDEX_TAIL = 1024
"""Columns past the step's tokens each zeroing program of the index fill covers."""


def control_step_triton(index: torch.Tensor, gate_score: torch.Tensor, control: torch.Tensor,
                        acc: torch.Tensor) -> None:
    """CUDA implementation of :func:`.ops.control_step`: two launches whose arguments never
    change (so the pair can be captured in a CUDA graph and replayed each step). It reads every
    column of ``index``: columns past the step's tokens are zero (no controller), as the
    token index keeps them (:mod:`.token_rows`)."""
    if index.stride(-1) != 1 or gate_score.stride(-1) != 1 or not control.is_contiguous():
        raise ValueError("dynsteer control_step: index, gate_score and control need unit stride")
    width = index.shape[-1]
    _fold_gather_kernel[(triton.cdiv(width, FOLD_BLOCK),)](
        index, gate_score, control, acc, width, index.stride(0), gate_score.stride(0),
        BLOCK=FOLD_BLOCK, num_warps=4)
    _fold_apply_kernel[(control.shape[0] - 1,)](gate_score, control, acc, gate_score.stride(0),
                                                num_warps=1)


@triton.jit
def _stats_read_kernel(ops_ptr, stats_ptr, readout_ptr, slots, COLS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Read-outs: column ``i`` of ``readout`` is the column of the i-th slot asked for."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mine = i < tl.load(ops_ptr)
    k = tl.load(ops_ptr + OPS_HEAD + i, mask=mine, other=0)
    for c in tl.static_range(COLS):
        value = tl.load(stats_ptr + c * slots + k, mask=mine, other=0)
        tl.store(readout_ptr + c * slots + i, value, mask=mine)


@triton.jit
def _stats_write_kernel(ops_ptr, stats_ptr, slots, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Writes: the i-th slot written gets the i-th column of the op buffer."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    reads = tl.load(ops_ptr)
    writes = tl.load(ops_ptr + 1)
    mine = i < writes
    k = tl.load(ops_ptr + OPS_HEAD + reads + i, mask=mine, other=0)
    base = ops_ptr + OPS_HEAD + reads + writes + i * COLS
    for c in tl.static_range(COLS):
        tl.store(stats_ptr + c * slots + k, tl.load(base + c, mask=mine, other=0), mask=mine)


@triton.jit
def _stats_fold_kernel(ops_ptr, index_ptr, gate_score_ptr, stats_ptr, site_counts_ptr, width,
                       slots, index_stride, gate_score_stride, gate_on, epsilon,
                       BLOCK: tl.constexpr):
    """One program per block of token columns: each token with a probe row adds itself to
    its slot's statistics with atomics (see :mod:`.gate_stats`, whose numpy fold it must
    equal)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < width * (tl.load(ops_ptr + 2) != 0)  # an ops-only replay folds nothing
    probe = tl.load(index_ptr + INDEX_PROBE * index_stride + offs, mask=inside, other=0)
    mine = inside & (probe != 0)
    k = tl.load(index_ptr + INDEX_SLOT * index_stride + offs, mask=mine, other=0).to(tl.int64)
    mine = mine & (k < slots)  # a slot past the table is not counted
    e = tl.load(index_ptr + INDEX_POS * index_stride + offs, mask=mine, other=0).to(tl.int64)
    start = tl.load(stats_ptr + ST_START * slots + k, mask=mine, other=0)
    p = tl.where((e & POS_ABSOLUTE) != 0, e - POS_ABSOLUTE, start + e)
    g = tl.load(gate_score_ptr + GATE * gate_score_stride + offs, mask=mine, other=0.0)
    s = tl.load(gate_score_ptr + SCORE * gate_score_stride + offs, mask=mine, other=0.0)
    one = tl.full([BLOCK], 1, tl.int64)
    on = g > gate_on
    site = tl.load(stats_ptr + ST_SITE * slots + k, mask=mine, other=0)
    tl.atomic_add(site_counts_ptr + site * 2, one, mask=mine)
    tl.atomic_add(site_counts_ptr + site * 2 + 1, one, mask=mine & on)
    new = mine & (p >= tl.load(stats_ptr + ST_FRONTIER * slots + k, mask=mine, other=0))
    prompt = p < tl.load(stats_ptr + ST_PROMPT_LEN * slots + k, mask=mine, other=0)
    tl.atomic_add(stats_ptr + ST_MONITORED * slots + k, one, mask=new)
    tl.atomic_add(stats_ptr + ST_GATED_PREFILL * slots + k, one, mask=new & on & prompt)
    decode_on = new & on & ~prompt
    tl.atomic_add(stats_ptr + ST_GATED_DECODE * slots + k, one, mask=decode_on)
    tl.atomic_min(stats_ptr + ST_FIRST_DECODE_GATED * slots + k, p, mask=decode_on)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # gate_stats.score_key
    tl.atomic_max(stats_ptr + ST_MAX_SCORE * slots + k, key, mask=mine & (s == s))
    dynamic_from = tl.load(stats_ptr + ST_DYNAMIC_FROM * slots + k, mask=mine, other=0)
    hot = mine & (g > epsilon) & (p >= dynamic_from)
    tl.atomic_min(stats_ptr + ST_FIRST_DYNAMIC * slots + k, p, mask=hot)
    tl.atomic_max(stats_ptr + ST_UPTO * slots + k, p + 1, mask=mine)
    tl.atomic_max(stats_ptr + ST_NEXT * slots + k, p + 1, mask=mine)


@triton.jit
def _stats_frontier_kernel(ops_ptr, stats_ptr, slots, BLOCK: tl.constexpr):
    """After the fold, per slot: ``FRONTIER = UPTO`` (the next step's positions below it
    were counted) and, where the step had tokens, ``START = NEXT`` (``NEXT = 0``); the op
    buffer's head is reset (no read-outs or writes next time unless uploaded)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < slots
    upto = tl.load(stats_ptr + ST_UPTO * slots + offs, mask=inside)
    tl.store(stats_ptr + ST_FRONTIER * slots + offs, upto, mask=inside)
    after = tl.load(stats_ptr + ST_NEXT * slots + offs, mask=inside, other=0)
    tl.store(stats_ptr + ST_START * slots + offs, after, mask=inside & (after > 0))
    tl.store(stats_ptr + ST_NEXT * slots + offs, tl.zeros_like(after), mask=inside & (after > 0))
    if tl.program_id(0) == 0:
        head = tl.arange(0, 4)
        tl.store(ops_ptr + head, (head == 2).to(tl.int64), mask=head < 3)


def stats_step_triton(ops: torch.Tensor, index: torch.Tensor, gate_score: torch.Tensor,
                      stats: torch.Tensor, site_counts: torch.Tensor,
                      readout: torch.Tensor) -> None:
    """CUDA implementation of a step of :class:`.gate_stats.GateStats`: read-outs, writes
    (both from the op buffer ``ops``), the fold of :func:`.gate_stats.fold_numpy`, the
    frontier. Four launches whose arguments never change (captured in CUDA graphs and
    replayed each step). The fold reads every column of ``index``: columns past the step's
    tokens are zero (no probe row)."""
    if (index.stride(-1) != 1 or gate_score.stride(-1) != 1 or not stats.is_contiguous()
            or not site_counts.is_contiguous() or not readout.is_contiguous()):
        raise ValueError("dynsteer gate statistics: index and gate_score need unit stride, "
                         "stats, site_counts and readout must be contiguous")
    width, slots = index.shape[-1], stats.shape[1]
    cols = stats.shape[0]
    per_slot = (triton.cdiv(slots, FOLD_BLOCK),)
    _stats_read_kernel[per_slot](ops, stats, readout, slots, COLS=cols, BLOCK=FOLD_BLOCK)
    _stats_write_kernel[per_slot](ops, stats, slots, COLS=cols, BLOCK=FOLD_BLOCK)
    _stats_fold_kernel[(triton.cdiv(width, FOLD_BLOCK),)](
        ops, index, gate_score, stats, site_counts, width, slots, index.stride(0),
        gate_score.stride(0), gate_stats.GATE_ON, DYNAMIC_EPSILON, BLOCK=FOLD_BLOCK,
        num_warps=4)
    _stats_frontier_kernel[per_slot](ops, stats, slots, BLOCK=FOLD_BLOCK)


@triton.jit
def _index_fill_kernel(index_ptr, table_ptr, slots_ptr, query_start_ptr, positions_ptr,
                       index_stride, table_stride, requests, width, BLOCK: tl.constexpr,
                       TAIL: tl.constexpr, RELATIVE: tl.constexpr):
    """Program ``b < requests``: the tokens of the b-th request of the batch (none for a
    request past the batch: vLLM pads ``query_start_loc`` with the step's token count);
    program ``requests + c``: zeroes columns ``[c * TAIL, (c + 1) * TAIL)`` past the step's
    tokens. ``RELATIVE``: every request's tokens continue where its previous step ended, so
    each token's position entry is its offset from there (the statistics' ``START``): 0 for
    the one token of a decode step, the same in every such step."""
    b = tl.program_id(0)
    tokens = tl.load(query_start_ptr + requests)
    if b >= requests:
        offs = (b - requests) * TAIL + tl.arange(0, TAIL)
        past = (offs >= tokens) & (offs < width)
        for r in tl.static_range(INDEX_ROWS):
            tl.store(index_ptr + r * index_stride + offs, tl.zeros([TAIL], tl.int32), mask=past)
    else:
        start = tl.load(query_start_ptr + b)
        end = tl.load(query_start_ptr + b + 1)
        if start < end:
            slot = tl.load(slots_ptr + b)
            prefill = tl.load(table_ptr + SLOT_PREFILL * table_stride + slot)
            decode = tl.load(table_ptr + SLOT_DECODE * table_stride + slot)
            probe = tl.load(table_ptr + SLOT_PROBE * table_stride + slot)
            prompt_len = tl.load(table_ptr + SLOT_PROMPT_LEN * table_stride + slot)
            zero = tl.zeros([BLOCK], tl.int32)
            for first in range(start, end, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                inside = offs < end
                pos = tl.load(positions_ptr + offs, mask=inside, other=0).to(tl.int32)
                row = tl.where(pos < prompt_len, prefill, decode)
                tl.store(index_ptr + INDEX_ROW * index_stride + offs, row, mask=inside)
                tl.store(index_ptr + INDEX_PROBE * index_stride + offs, zero + probe,
                         mask=inside)
                tl.store(index_ptr + INDEX_CAPTURE * index_stride + offs, zero, mask=inside)
                tl.store(index_ptr + INDEX_CONTROL * index_stride + offs, zero, mask=inside)
                tl.store(index_ptr + INDEX_SLOT * index_stride + offs, zero + slot,
                         mask=inside)
                entry = offs - start if RELATIVE else pos | POS_ABSOLUTE
                tl.store(index_ptr + INDEX_POS * index_stride + offs, entry, mask=inside)


def index_fill_triton(index: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
                      query_start_loc: torch.Tensor, positions: torch.Tensor,
                      relative: bool = False) -> None:
    """CUDA implementation of the per-token index fill from per-slot values (see
    :class:`.token_rows.DeviceFill`). Request ``b`` of the step is in slot ``slots[b]`` and
    owns tokens ``query_start_loc[b]`` to ``query_start_loc[b + 1]``, at ``positions``; the
    step's token count is ``query_start_loc[-1]``. Every argument is a persistent buffer and
    the grid covers the largest batch, so the launch is captured once and replayed.
    ``relative``: position entries relative to where each request's previous step ended
    (valid only when every request continues from there)."""
    requests, width = slots.shape[0], index.shape[1]
    if query_start_loc.shape[0] != requests + 1 or table.stride(1) != 1:
        raise ValueError("dynsteer index fill: query_start_loc needs one entry per slot of "
                         "the batch and one more; the slot table must be row-major")
    grid = (requests + triton.cdiv(width, INDEX_TAIL),)
    _index_fill_kernel[grid](index, table, slots, query_start_loc, positions, index.stride(0),
                             table.stride(0), requests, width, BLOCK=INDEX_BLOCK,
                             TAIL=INDEX_TAIL, RELATIVE=relative, num_warps=1)


def captured(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``run`` (launches with fixed arguments) as a CUDA graph to replay each step: run once
    first, outside the capture, so its kernels are compiled."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


MAX_BLOCK = 4096
"""The longest stream block of ``_steer_kernel``: one block holds a row of hidden size up to
this (one pass, no loop, at batch 1 where the kernel's time is its load latency)."""


def _block_for(hidden: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(hidden))


def steer_triton(x: torch.Tensor, h: torch.Tensor | None, b: ops.SteerBuffers, site: int,
                 limit: float) -> torch.Tensor:
    """CUDA implementation of ``dynsteer::steer``: reads the first ``x.shape[0]`` columns of
    ``index`` and ``gate_score`` (row strides are passed; element strides must be 1)."""
    x, h = _unit_stride(x), None if h is None else _unit_stride(h)
    _check_buffers(b)
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


def steer_norm_triton(x: torch.Tensor, h: torch.Tensor, b: ops.SteerBuffers, site: int,
                      limit: float, weight: torch.Tensor, eps: float, monitor: bool = True,
                      site_bit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA implementation of ``dynsteer::steer_norm``: the site, then the fused add +
    RMSNorm, in one program per token; the engine has no projection slots (checked by the
    caller) and ``hidden <= ops.MAX_NORM_ROW``. ``monitor`` False compiles out the probe and
    capture code, for a site where neither ever happens; ``site_bit`` (0: none) is the site's
    group bit, without which a token's entry steers nothing here."""
    x, h = _unit_stride(x), _unit_stride(h)
    _check_buffers(b)
    tokens, hidden = x.shape
    if b.proj_dir.shape[1] or hidden > ops.MAX_NORM_ROW:
        raise ValueError(f"dynsteer::steer_norm: {b.proj_dir.shape[1]} projection slots, "
                         f"hidden {hidden} (needs none and at most {ops.MAX_NORM_ROW})")
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


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_buffers(b: ops.SteerBuffers) -> None:
    if b.index.stride(-1) != 1 or b.gate_score.stride(-1) != 1 or not b.capture.is_contiguous():
        # Not copied: the writes to gate_score and capture would be lost.
        raise ValueError("dynsteer::steer: index, gate_score and capture need unit stride")
    if not (b.proj_dir.is_contiguous() and b.proj_par.is_contiguous()
            and b.proj_gram.is_contiguous()):
        raise ValueError("dynsteer::steer: the projection tables must be contiguous")
