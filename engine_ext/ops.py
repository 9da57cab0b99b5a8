"""The in-graph steering op: ``dynsteer::steer_add``.

One call per configured site. It reads only persistent buffers (the per-token row index and the
site's row table), so it is safe inside torch.compile graphs and CUDA-graph replay: on replay
only its kernel runs, on the captured addresses. It is functional (returns a new tensor), never
syncs with the host and never reads Python state.

    out[t] = x[t] + table[rows[t]]      (fp32 math, cast back to x.dtype; row 0 is all zeros)

CUDA uses the Triton kernel in :mod:`.triton_kernels`; every other device uses torch.
"""

from __future__ import annotations

import torch

OP_NAMESPACE = "dynsteer"


def steer_add_reference(x: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Plain torch version; also the CPU implementation."""
    delta = table.index_select(0, rows.to(torch.long))
    if x.dtype == torch.float32:
        return x + delta
    return (x.to(torch.float32) + delta).to(x.dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::steer_add", mutates_args=())
def steer_add(x: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Add ``table[rows[t]]`` to every token ``t`` of ``x`` (``[T, H]``)."""
    if x.is_cuda:
        from dynsteer.engine_ext.triton_kernels import steer_add_triton

        return steer_add_triton(x, rows, table)
    return steer_add_reference(x, rows, table)


@steer_add.register_fake
def _steer_add_fake(x: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
