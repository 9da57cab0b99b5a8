"""The per-token index filled on the device from per-slot values (see
:class:`..token_rows.DeviceFill`): one kernel over the largest batch, replayed from a CUDA
graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tl import (
    INDEX_CAPTURE,
    INDEX_CONTROL,
    INDEX_POS,
    INDEX_PROBE,
    INDEX_ROW,
    INDEX_ROWS,
    INDEX_SLOT,
    POS_ABSOLUTE,
    SLOT_DECODE,
    SLOT_PREFILL,
    SLOT_PROBE,
    SLOT_PROMPT_LEN,
)

INDEX_BLOCK = 128
"""Tokens per loop iteration of the index fill (a decode request has one)."""


INDEX_TAIL = 1024
"""Columns past the step's tokens each zeroing program of the index fill covers."""


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
