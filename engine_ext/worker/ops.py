"""The in-graph steering op: ``dynsteer::steer``, one call per configured site.

For every token ``t`` of the step (``x`` is the tensor steered, ``h`` the other half of the
residual stream, so the stream is ``x + h``; ``h`` is None where ``x`` is the whole stream):

    p = probe_rows[t]                                   (0: no probe)
    if p and params[p].site == site:                    (this is t's monitor site)
        score[t] = (x[t] + h[t]) · probes[p]            (fp32 accumulate)
        gate[t]  = sigmoid(params[p].sharpness * (score[t] - params[p].threshold))   (NaN: 0)
    c, lane = capture_rows[t], site_lane[site]          (0 / -1: not captured)
    if c and lane >= 0:
        capture[lane, c] = x[t] + h[t]                   (fp32, the stream the monitor reads)
    y = x[t] + table[rows[t]] + gate[t] * dyn[rows[t]]      (fp32)
    out[t] = y where |y| <= limit, else x[t]                (element-wise; NaN fails the test)

Row 0 of ``table``/``dyn`` is zero (not steered); ``flags[row]`` says which of the two a row
uses so unused rows are never read. The monitor reads the stream *before* this site's
steering; the gate stays in the per-token ``gate`` buffer so later sites of the same forward
use it (cross-layer gating).

The last line is the data plane's own defence against bad numbers (every value was already
checked when it entered, see :mod:`dynsteer.controller.limits`): ``limit`` is
``STREAM_ABS_LIMIT`` or the largest finite value of ``x``'s dtype, whichever is smaller, so no
steered element ever leaves the op as NaN, inf or large enough to overflow the next norm. Such
activations would otherwise reach KV blocks that vLLM later hands to other requests, and
corrupt *their* outputs. An element the model itself made non-finite is passed through as is.

Capture (activations for probe training, see :mod:`.capture_buffers`) stores the same
pre-steering stream into ``capture[K, C + 1, H]``: ``site_lane[S]`` maps each site to one of
the K lanes (-1: this site is not being captured) and ``capture_rows[t]`` is the capture row
of token ``t``, 0 meaning "not captured" like row 0 everywhere else, so padding tokens and a
cleared index never write (row 0 of the buffer is never written). The buffer is float32: it
holds exactly the fp32 sum the monitor's probes are applied to, and numpy (the consumer) has
no bfloat16. Tokens that are not captured cost one int load.

Graph safety: every input is a persistent buffer updated in place between steps; no host sync
on CUDA, no Python state. ``gate``/``score`` are per-token scratch outputs written in place but
*not* declared as mutated: declaring them would make functionalization copy both buffers at
every site. Their writes are ordered by the residual stream itself (a later site's input is
computed from an earlier site's output), which no compiler pass can reorder. ``capture`` is
written in place and not declared either, for the same reason (it is large); nothing in the
graph reads it: it is read between steps, by an RPC, after the forward has finished.
CUDA runs the Triton kernel in :mod:`.triton_kernels`; other devices run torch.
"""

from __future__ import annotations

import torch

from dynsteer.controller.limits import STREAM_ABS_LIMIT

OP_NAMESPACE = "dynsteer"
STATIC_FLAG = 1
DYNAMIC_FLAG = 2
PARAM_THRESHOLD, PARAM_SHARPNESS, PARAM_SITE = 0, 1, 2


def _monitor(x, h, probe_rows, probes, params, gate, score, site: int) -> None:
    p = probe_rows.to(torch.long)
    mine = (p != 0) & (params[p, PARAM_SITE] == site)
    if not bool(mine.any()):
        return
    idx = mine.nonzero().squeeze(1)
    stream = x.index_select(0, idx).to(torch.float32)
    if h is not None:
        stream = stream + h.index_select(0, idx).to(torch.float32)
    pi = p.index_select(0, idx)
    s = (stream * probes.index_select(0, pi)).sum(-1)
    z = params[pi, PARAM_SHARPNESS] * (s - params[pi, PARAM_THRESHOLD])
    score[idx] = s
    gate[idx] = torch.nan_to_num(torch.sigmoid(z), nan=0.0)


def _capture(x, h, capture_rows, capture, site_lane, site: int) -> None:
    lane = int(site_lane[site])  # host memory: this torch version only runs on CPU
    if lane < 0:
        return
    c = capture_rows.to(torch.long)
    idx = (c != 0).nonzero().squeeze(1)
    if idx.numel() == 0:
        return
    stream = x.index_select(0, idx).to(torch.float32)
    if h is not None:
        stream = stream + h.index_select(0, idx).to(torch.float32)
    capture[lane].index_copy_(0, c.index_select(0, idx), stream)


def steer_torch(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score,
                capture_rows, capture, site_lane, site: int) -> torch.Tensor:
    """Plain torch version; the CPU implementation."""
    _capture(x, h, capture_rows, capture, site_lane, site)
    _monitor(x, h, probe_rows, probes, params, gate, score, site)
    r = rows.to(torch.long)
    delta = table.index_select(0, r)
    if bool(((flags.index_select(0, r) & DYNAMIC_FLAG) != 0).any()):
        delta = delta + gate[: x.shape[0], None] * dyn.index_select(0, r)
    x32 = x.to(torch.float32)
    y = x32 + delta
    y = torch.where(y.abs() <= stream_limit(x.dtype), y, x32)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def stream_limit(dtype: torch.dtype) -> float:
    """Largest magnitude a steered element may have (see the module docstring)."""
    return min(STREAM_ABS_LIMIT, float(torch.finfo(dtype).max))


@torch.library.custom_op(f"{OP_NAMESPACE}::steer", mutates_args=())
def steer(
    x: torch.Tensor, h: torch.Tensor | None, rows: torch.Tensor, probe_rows: torch.Tensor,
    table: torch.Tensor, dyn: torch.Tensor, flags: torch.Tensor, probes: torch.Tensor,
    params: torch.Tensor, gate: torch.Tensor, score: torch.Tensor, capture_rows: torch.Tensor,
    capture: torch.Tensor, site_lane: torch.Tensor, site: int,
) -> torch.Tensor:
    """Capture + monitor + static + gated steering of one site (see the module docstring)."""
    if x.is_cuda:
        from .triton_kernels import steer_triton

        return steer_triton(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate,
                            score, capture_rows, capture, site_lane, site, stream_limit(x.dtype))
    return steer_torch(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score,
                       capture_rows, capture, site_lane, site)


@steer.register_fake
def _steer_fake(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score,
                capture_rows, capture, site_lane, site):
    return torch.empty_like(x)
