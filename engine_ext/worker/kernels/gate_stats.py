"""The gate statistics' step on CUDA (see :mod:`..gate_stats`): read-outs, writes, the fold
and the frontier, four launches replayed as one CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...prefix_guard.guard import DYNAMIC_EPSILON
from .. import layout
from ._tl import (
    FOLD_BLOCK,
    GATE,
    INDEX_POS,
    INDEX_PROBE,
    INDEX_SLOT,
    OPS_HEAD,
    POS_ABSOLUTE,
    SCORE,
    ST_DYNAMIC_FROM,
    ST_FIRST_DECODE_GATED,
    ST_FIRST_DYNAMIC,
    ST_FIRST_GATED,
    ST_FRONTIER,
    ST_GATED_DECODE,
    ST_GATED_PREFILL,
    ST_MAX_SCORE,
    ST_MONITORED,
    ST_NEXT,
    ST_PROMPT_LEN,
    ST_SITE,
    ST_START,
    ST_UPTO,
)


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
    tl.atomic_min(stats_ptr + ST_FIRST_GATED * slots + k, p, mask=new & on)
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
        gate_score.stride(0), layout.GATE_ON, DYNAMIC_EPSILON, BLOCK=FOLD_BLOCK,
        num_warps=4)
    _stats_frontier_kernel[per_slot](ops, stats, slots, BLOCK=FOLD_BLOCK)
