"""The built-in controllers' fold on CUDA (see :func:`..ops.control_step`): after each
forward, the step's scores folded into the controller rows, two launches the worker replays as
a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tl import (
    CTL_COLS,
    CTL_COUNT,
    CTL_FLOOR,
    CTL_KIND,
    CTL_P0,
    CTL_P1,
    CTL_P2,
    CTL_SCALE,
    FOLD_BLOCK,
    GATE,
    INDEX_CONTROL,
    KIND_BUDGET,
    KIND_HYSTERESIS,
    KIND_LATCH,
    KIND_PROPORTIONAL,
    SCORE,
)

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
