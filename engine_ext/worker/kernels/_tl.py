"""What every kernel module shares: the layout constants (:mod:`..layout`) as ``tl.constexpr``
globals (a jitted function may read only those), the site kernels' common jitted helpers and
the host helpers around the launches."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .. import layout

if TYPE_CHECKING:
    from ..buffers import SteerBuffers


# The layout constants, as globals a jitted function may read.
STATIC_FLAG = tl.constexpr(layout.STATIC_FLAG)
DYNAMIC_FLAG = tl.constexpr(layout.DYNAMIC_FLAG)
PROJECT_FLAG = tl.constexpr(layout.PROJECT_FLAG)
PROJ_STATIC = tl.constexpr(layout.PROJ_STATIC)
PROJ_GATED = tl.constexpr(layout.PROJ_GATED)
PROJ_VALUE = tl.constexpr(layout.PROJ_VALUE)
PROJ_NORM = tl.constexpr(layout.PROJ_NORM)
PROJ_PARAMS = tl.constexpr(layout.PROJ_PARAMS)
PARAM_THRESHOLD = tl.constexpr(layout.PARAM_THRESHOLD)
PARAM_SHARPNESS = tl.constexpr(layout.PARAM_SHARPNESS)
PARAM_SITE = tl.constexpr(layout.PARAM_SITE)
INDEX_ROW = tl.constexpr(layout.INDEX_ROW)
ROW_MASK = tl.constexpr(layout.ROW_MASK)
INDEX_PROBE = tl.constexpr(layout.INDEX_PROBE)
INDEX_CAPTURE = tl.constexpr(layout.INDEX_CAPTURE)
INDEX_CONTROL = tl.constexpr(layout.INDEX_CONTROL)
INDEX_SLOT = tl.constexpr(layout.INDEX_SLOT)
INDEX_POS = tl.constexpr(layout.INDEX_POS)
CTL_KIND = tl.constexpr(layout.CTL_KIND)
CTL_FLOOR = tl.constexpr(layout.CTL_FLOOR)
CTL_SCALE = tl.constexpr(layout.CTL_SCALE)
CTL_COUNT = tl.constexpr(layout.CTL_COUNT)
CTL_P0 = tl.constexpr(layout.CTL_P0)
CTL_P1 = tl.constexpr(layout.CTL_P1)
CTL_P2 = tl.constexpr(layout.CTL_P2)
CTL_COLS = tl.constexpr(layout.CTL_COLS)
KIND_LATCH = tl.constexpr(layout.KIND_LATCH)
KIND_HYSTERESIS = tl.constexpr(layout.KIND_HYSTERESIS)
KIND_PROPORTIONAL = tl.constexpr(layout.KIND_PROPORTIONAL)
KIND_BUDGET = tl.constexpr(layout.KIND_BUDGET)
ST_FIRST_DYNAMIC = tl.constexpr(layout.FIRST_DYNAMIC)
ST_UPTO = tl.constexpr(layout.UPTO)
ST_MONITORED = tl.constexpr(layout.MONITORED)
ST_GATED_PREFILL = tl.constexpr(layout.GATED_PREFILL)
ST_GATED_DECODE = tl.constexpr(layout.GATED_DECODE)
ST_FIRST_DECODE_GATED = tl.constexpr(layout.FIRST_DECODE_GATED)
ST_FIRST_GATED = tl.constexpr(layout.FIRST_GATED)
ST_MAX_SCORE = tl.constexpr(layout.MAX_SCORE)
OPS_HEAD = tl.constexpr(layout.OPS_HEAD)
ST_START = tl.constexpr(layout.START)
ST_NEXT = tl.constexpr(layout.NEXT)
POS_ABSOLUTE = tl.constexpr(layout.POS_ABSOLUTE)
ST_FRONTIER = tl.constexpr(layout.FRONTIER)
ST_PROMPT_LEN = tl.constexpr(layout.PROMPT_LEN)
ST_DYNAMIC_FROM = tl.constexpr(layout.DYNAMIC_FROM)
ST_SITE = tl.constexpr(layout.SITE)
GATE = tl.constexpr(layout.GATE)
SCORE = tl.constexpr(layout.SCORE)
INDEX_ROWS = tl.constexpr(layout.INDEX_ROWS)
SLOT_PREFILL = tl.constexpr(layout.SLOT_PREFILL)
SLOT_DECODE = tl.constexpr(layout.SLOT_DECODE)
SLOT_PROBE = tl.constexpr(layout.SLOT_PROBE)
SLOT_PROMPT_LEN = tl.constexpr(layout.SLOT_PROMPT_LEN)


@triton.jit
def stream_block(x_ptr, h_ptr, t, x_stride, h_stride, offs, mask, HAS_H: tl.constexpr):
    """The site's stream at ``offs`` of token ``t`` in float32: ``x``, plus ``h`` where the
    site reads the residual stream as two halves (``HAS_H``)."""
    s = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_H:
        s += tl.load(h_ptr + t * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def probe_gate(score, param_ptr, control_ptr, index_ptr, index_stride, t):
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


FOLD_BLOCK = 256


def captured(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``run`` (launches with fixed arguments) as a CUDA graph to replay each step: run once
    first, outside the capture, so its kernels are compiled."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_buffers(b: SteerBuffers) -> None:
    if b.index.stride(-1) != 1 or b.gate_score.stride(-1) != 1 or not b.capture.is_contiguous():
        # Not copied: the writes to gate_score and capture would be lost.
        raise ValueError("dynsteer::steer: index, gate_score and capture need unit stride")
    if not (b.proj_dir.is_contiguous() and b.proj_par.is_contiguous()
            and b.proj_gram.is_contiguous()):
        raise ValueError("dynsteer::steer: the projection tables must be contiguous")
