"""Triton kernels for CUDA. Imported only when a CUDA tensor reaches an op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _steer_add_kernel(
    x_ptr, rows_ptr, table_ptr, out_ptr, hidden, x_stride, out_stride, BLOCK: tl.constexpr
):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    row = tl.load(rows_ptr + token).to(tl.int64)
    x = tl.load(x_ptr + token.to(tl.int64) * x_stride + offs, mask=mask, other=0.0)
    # Row 0 is all zeros: skip its read so unsteered tokens cost one read + one write.
    delta = tl.load(table_ptr + row * hidden + offs, mask=mask & (row != 0), other=0.0)
    out = x.to(tl.float32) + delta
    tl.store(out_ptr + token.to(tl.int64) * out_stride + offs, out.to(out_ptr.dtype.element_ty),
             mask=mask)


def _block_for(hidden: int) -> int:
    return min(4096, triton.next_power_of_2(hidden))


def steer_add_triton(x: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """CUDA implementation of ``dynsteer::steer_add`` (see :mod:`.ops`)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    block = _block_for(hidden)
    grid = (tokens, triton.cdiv(hidden, block))
    _steer_add_kernel[grid](
        x, rows, table, out, hidden, x.stride(0), out.stride(0), BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )
    return out
