"""The in-graph steering: ``dynsteer::steer`` at monitor sites, :func:`steer_add` elsewhere.

For every token ``t`` of the step (``x`` is the tensor steered, ``h`` the other half of the
residual stream, so the stream is ``x + h``; ``h`` is None where ``x`` is the whole stream;
``gate``/``score`` are the rows ``GATE``/``SCORE`` of ``gate_score``):

    r = index[INDEX_ROW, t] & ROW_MASK                  (0: none; the high bits: site groups)
    p, c = index[INDEX_PROBE, t], index[INDEX_CAPTURE, t]  (0: none)
    k = index[INDEX_CONTROL, t]                         (0: no controller)
    if p and params[p, PARAM_SITE] == site:             (this is t's monitor site)
        score[t] = (x[t] + h[t]) · probes[p]            (fp32 accumulate)
        gate[t]  = sigmoid(params[p, PARAM_SHARPNESS] * (score[t] - params[p, PARAM_THRESHOLD]))
                                                        (NaN: 0)
        if k and gate[t] was not NaN:
            gate[t] = max(gate[t], control[k, CTL_FLOOR]) * control[k, CTL_SCALE]
    lane = site_lane[site]                              (-1: this site is not captured)
    if c and lane >= 0:
        capture[lane, c] = x[t] + h[t]                   (fp32, the stream the monitor reads)
    P = 0
    if flags[r] & PROJECT_FLAG:                          (ablate / clamp, in slot order)
        s[d] = (x[t] + h[t]) · proj_dir[r, d]            (fp32, every slot d at once)
        n = ‖x[t] + h[t]‖                                (fp32)
        for d in 0..D-1:
            c = proj_par[r, d, STATIC] + gate[t] * proj_par[r, d, GATED]
            if proj_par[r, d, NORM]:                     (a norm-matched add)
                delta[d] = c * n
            else:
                seen = s[d] + sum_{e<d} delta[e] * proj_gram[r, e, d]
                delta[d] = c * (proj_par[r, d, VALUE] - seen)
        P = sum_d delta[d] * proj_dir[r, d]
    y = x[t] + P + table[r] + gate[t] * dyn[r]          (fp32)
    out[t] = y where |y| <= limit, else x[t]            (element-wise; NaN fails the test)

The op's inputs besides ``x``, ``h`` and ``site`` are the fields of :class:`SteerBuffers`, in
that order (the op's schema is derived from it). ``index`` and ``gate_score`` are the whole
per-token buffers (``max_tokens`` columns): the op reads and writes only the first
``T = x.shape[0]`` columns, so callers pass them unsliced.

Row 0 of ``table``/``dyn`` is zero (not steered); ``flags[row]`` says which of the two a row
uses so unused rows are never read.

Projections (``ablate`` / ``clamp`` entries, see :mod:`dynsteer.controller.spec`) act on the
incoming stream, before the adds, one after the other in slot order: slot ``d`` sees the stream
as the slots before it left it, ``z_d = z_0 + sum_{e<d} delta[e] * dir[e]``, whose projection
on ``dir[d]`` is ``s[d] + sum_{e<d} delta[e] * gram[e, d]``. So one pass over the stream (the
dot products with every slot's direction) gives all of them, exactly as applying them in
sequence would. A ``norm_match`` add takes a slot too, after the site's ablate / clamp slots:
it adds ``c * ‖stream‖`` along its unit direction, ``‖stream‖`` being the incoming stream's
norm, computed in the same pass. Unused slots have zero coefficients (their delta is 0). With
``max_projections`` 0 (the default) the tables have no slots and none of this is traced.

The monitor reads the stream *before* this site's steering; the gate stays in the per-token
``gate`` buffer so later sites of the same forward use it (cross-layer gating).

The last line is the data plane's own defence against bad numbers (every value was already
checked when it entered, see :mod:`dynsteer.controller.limits`): ``limit`` is
``STREAM_ABS_LIMIT`` or the largest finite value of ``x``'s dtype, whichever is smaller, so no
steered element ever leaves the op as NaN, inf or large enough to overflow the next norm. Such
activations would otherwise reach KV blocks that vLLM later hands to other requests, and
corrupt *their* outputs. An element the model itself made non-finite is passed through as is.
A fused site (:func:`steer_add`) also adds nothing where ``h`` is NaN (the stream is NaN there
whatever is added): that ties its arithmetic to the kernel that adds ``h``.

Capture (activations for probe training, see :mod:`.capture_buffers`) stores the same
pre-steering stream into ``capture[K, C + 1, H]``: ``site_lane[S]`` maps each site to one of
the K lanes (-1: this site is not being captured) and ``index[INDEX_CAPTURE, t]`` is the
capture row of token ``t``, 0 meaning "not captured" like row 0 everywhere else, so padding
tokens and a cleared index never write (row 0 of the buffer is never written). The buffer is
float32: it holds exactly the fp32 sum the monitor's probes are applied to, and numpy (the
consumer) has no bfloat16. Tokens that are not captured cost one int load.

A site that is not a monitor site (no probe reads it, nothing is captured there) needs only
the last two lines; :func:`steer_add` computes them with tensor ops the compiler fuses into
the kernels around the site, so such a site launches no kernel of its own. With the engine
option ``fused_norms``, where vLLM's RMSNorm follows a site, CUDA runs :func:`steer_norm`
instead, any site: this op and the norm in one kernel.

``control[K, CTL_COLS]`` holds the state of per-request controllers (one row per runner slot,
see :mod:`dynsteer.controller.controllers`): the monitor applies a row's floor and scale; after
each forward :func:`control_step` folds the step's scores into the rows of built-in
controllers (one small kernel, outside the graph), so their decisions apply from the next step.

Graph safety: every input is a persistent buffer updated in place between steps (``index``
is read only; the CUDA path reads its shapes and strides, never its values, on the host): no
host sync on CUDA, no Python state. ``gate_score`` is per-token scratch written in place but
*not* declared as mutated: declaring it would make functionalization copy the buffer at every
monitor site. The writes are ordered by the residual stream itself: a later site reads the
gate in the same expression as its input ``x``, which is computed from the monitor op's
output, so no compiler pass can move the read before the write (the expression is fused into
the kernel that consumes ``x``; the gate alone is a view, never a buffer of its own).
``capture`` is written in place and not declared either; nothing in the graph reads it: it is
read between steps, by an RPC, after the forward.
CUDA runs the Triton kernels in :mod:`.kernels`; other devices run torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynsteer.controller.limits import STREAM_ABS_LIMIT

from .buffers import SteerBuffers
from .layout import (
    CTL_COUNT,
    CTL_FLOOR,
    CTL_KIND,
    CTL_P0,
    CTL_P1,
    CTL_P2,
    CTL_SCALE,
    DYNAMIC_FLAG,
    GATE,
    INDEX_CAPTURE,
    INDEX_CONTROL,
    INDEX_PROBE,
    INDEX_ROW,
    KIND_BUDGET,
    KIND_HYSTERESIS,
    KIND_LATCH,
    KIND_PROPORTIONAL,
    PARAM_SHARPNESS,
    PARAM_SITE,
    PARAM_THRESHOLD,
    PROJ_GATED,
    PROJ_NORM,
    PROJ_STATIC,
    PROJ_VALUE,
    PROJECT_FLAG,
    ROW_MASK,
    SCORE,
)

OP_NAMESPACE = "dynsteer"
_BUFFER_ARGS = "".join(f"Tensor {f}, " for f in SteerBuffers._fields)
STEER_SCHEMA = f"(Tensor x, Tensor? h, {_BUFFER_ARGS}int site) -> Tensor"
"""The op's schema, derived from :class:`SteerBuffers` (nothing declared as mutated: see the
module docstring), so adding an input is adding a field there and reading it in both
implementations."""
STEER_NORM_SCHEMA = (f"(Tensor x, Tensor h, {_BUFFER_ARGS}int site, Tensor weight, float eps,"
                     " bool monitor, int site_bit) -> (Tensor, Tensor)")
"""``dynsteer::steer_norm``: ``steer``'s inputs, then the weight and epsilon of the RMSNorm
that follows the site, whether probes or capture may read this site (False: the kernel
leaves their code out) and the site's group bit (:func:`site_bit`; 0: none)."""


def _monitor(x, h, probe_rows, control_rows, probes, params, control, gate, score,
             site: int) -> None:
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
    g = torch.nan_to_num(torch.sigmoid(z), nan=0.0)
    k = control_rows.to(torch.long).index_select(0, idx)
    ctl = control.index_select(0, k)
    controlled = (k != 0) & ~torch.isnan(z)  # a NaN score gates nothing, controller or not
    g = torch.where(controlled, torch.maximum(g, ctl[:, CTL_FLOOR]) * ctl[:, CTL_SCALE], g)
    score[idx] = s
    gate[idx] = g


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


def steer_torch(x: torch.Tensor, h: torch.Tensor | None, b: SteerBuffers,
                site: int) -> torch.Tensor:
    """Plain torch version; the CPU implementation."""
    n = x.shape[0]
    index = b.index[:, :n]
    gate, score = b.gate_score[GATE], b.gate_score[SCORE]
    _capture(x, h, index[INDEX_CAPTURE], b.capture, b.site_lane, site)
    _monitor(x, h, index[INDEX_PROBE], index[INDEX_CONTROL], b.probes, b.params, b.control,
             gate, score, site)
    r = (index[INDEX_ROW] & ROW_MASK).to(torch.long)
    delta = b.table.index_select(0, r)
    flags = b.flags.index_select(0, r)
    if bool(((flags & DYNAMIC_FLAG) != 0).any()):
        delta = delta + gate[:n, None] * b.dyn.index_select(0, r)
    x32 = x.to(torch.float32)
    projected = ((flags & PROJECT_FLAG) != 0).nonzero().squeeze(1)
    if projected.numel():
        stream = x32.index_select(0, projected)
        if h is not None:
            stream = stream + h.index_select(0, projected).to(torch.float32)
        delta[projected] += projection_change(
            stream, gate[:n].index_select(0, projected), r.index_select(0, projected),
            b.proj_dir, b.proj_par, b.proj_gram, _gather_rows)
    y = x32 + delta
    y = torch.where(y.abs() <= stream_limit(x.dtype), y, x32)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def steer_add(x: torch.Tensor, h: torch.Tensor | None, index: torch.Tensor,
              gate_score: torch.Tensor, table: torch.Tensor, dyn: torch.Tensor,
              proj_dir: torch.Tensor, proj_par: torch.Tensor,
              proj_gram: torch.Tensor, site_bit: int) -> torch.Tensor:
    """Static + gated steering of a site without monitor or capture: the op's last lines in
    tensor ops (see the module docstring), so the compiler fuses them into the kernels
    around the site. A row's unused tier is zero, so reading it adds exactly nothing; the
    gate is the token's, written at its monitor site earlier in the forward. Projection
    slots are read only when the engine has them (``max_projections``), and then by every
    steered token (unused slots are zero).

    With site groups (``site_bit`` nonzero, the default) a token whose entry lacks this
    site's bit (its row steers no site of this group) reads no row, and the site is tied to
    ``h`` (:func:`_within_limit`). ``site_bit`` 0 is the form without groups (engine option
    ``site_groups: false``, for measuring them against): entries are plain rows, and a
    steered token reads its row at every site."""
    n = x.shape[0]
    entry = index[INDEX_ROW, :n]
    if site_bit:
        rows = torch.where((entry & site_bit) != 0, entry & ROW_MASK, 0).to(torch.long)
        tie = h
    else:
        rows, tie = entry.to(torch.long), None
    gate = gate_score[GATE, :n]
    x32 = x.to(torch.float32)
    delta = _row_of(table, rows) + gate[:, None] * _row_of(dyn, rows)
    if proj_dir.shape[1]:  # max_projections > 0: fixed when the graph is traced
        stream = x32 if h is None else x32 + h.to(torch.float32)
        delta = delta + projection_change(stream, gate, rows, proj_dir, proj_par, proj_gram,
                                          _row_of)
    return (x32 + _within_limit(x32, tie, delta, x.dtype)).to(x.dtype)


def _within_limit(x32: torch.Tensor, h: torch.Tensor | None, delta: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """``delta`` where ``x32 + delta`` is within the stream limit, else 0: the op's last line
    (``where(|y| <= limit, y, x)``), written so that the steered sum has one user. As
    ``where(|y| <= limit, y, x32)`` the sum would have two; Inductor then stores it as a buffer
    of its own, splits the site over two kernels and reads the buffer back, which costs an
    idle site more than the check itself.

    Where ``h`` (the stream's other half) is NaN, ``delta`` is dropped too: the stream there is
    NaN whatever is added, so this changes no value the model sees, but it ties the site to
    ``h``. Without that tie the site's arithmetic needs only ``x``, which the norm *before*
    the MLP already reads, and Inductor may compute it there, store ``delta`` as an fp32
    ``[T, H]`` buffer and read it back in the next norm (a round trip through device memory
    per site and step). Tied to ``h``, it can only join the kernel that adds ``h``."""
    keep = (x32 + delta).abs() <= stream_limit(dtype)
    if h is not None:
        keep = keep & ~torch.isnan(h)
    return torch.where(keep, delta, 0.0)


def projection_change(stream: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor,
                      proj_dir: torch.Tensor, proj_par: torch.Tensor, proj_gram: torch.Tensor,
                      gather) -> torch.Tensor:
    """What the rows' projection slots add to each token's stream (fp32 ``[T, H]``), applied
    one after the other in slot order (see the module docstring); ``gather(table, rows)``
    reads the tokens' rows of the directions. Products and sums, not ``einsum``: Inductor
    fuses the gathers into one reduction and one pointwise kernel instead of materializing
    every token's directions for a batched matmul.

    The small tables (coefficients, Gram matrix: a few floats per row) are indexed directly:
    read through ``gather``'s padding, Inductor would materialize them with a device copy per
    site and step."""
    directions = gather(proj_dir, rows)                       # [T, D, H]
    par = proj_par[rows]                                      # [T, D, PROJ_PARAMS]
    s = (stream[:, None, :] * directions).sum(-1)
    norm = (stream * stream).sum(-1).sqrt()
    coef = par[..., PROJ_STATIC] + gate[:, None] * par[..., PROJ_GATED]
    gram = proj_gram[rows]                                    # [T, D, D]
    deltas: list[torch.Tensor] = []
    for d in range(directions.shape[1]):
        seen = s[:, d]
        for e, earlier in enumerate(deltas):
            seen = seen + earlier * gram[:, e, d]
        deltas.append(coef[:, d] * torch.where(par[:, d, PROJ_NORM] != 0, norm,
                                               par[:, d, PROJ_VALUE] - seen))
    return (torch.stack(deltas, dim=1)[..., None] * directions).sum(1)


def _gather_rows(rows_table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return rows_table.index_select(0, rows)


def _row_of(rows_table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows_table[rows]``, written so that a token on row 0 (all zeros) loads nothing: row 0
    is read as padding, which Inductor lowers to a masked load. Unsteered tokens (most of
    them, most of the time) then cost one index load per site instead of two row gathers."""
    return F.pad(rows_table[1:], (0, 0) * (rows_table.dim() - 1) + (1, 0))[rows]


def control_step(index: torch.Tensor, gate_score: torch.Tensor, control: torch.Tensor,
                 tokens: int, scratch: torch.Tensor | None = None) -> None:
    """Fold one finished step (its first ``tokens`` columns of ``index`` and ``gate_score``)
    into the rows of built-in controllers, in place (see :mod:`dynsteer.controller.controllers`
    for what each does). Runs on the step's stream after its forward and before the next one
    (so before the index is refilled). Other devices run torch; CUDA runs two Triton kernels
    with fixed arguments (:func:`.kernels.control_fold.control_step_triton`, which the worker
    replays as a CUDA graph): they read the whole index, whose columns past the step's tokens
    are zero, and keep counters in ``scratch`` (:func:`.kernels.control_fold.new_fold_scratch`)."""
    if control.is_cuda:
        from .kernels.control_fold import control_step_triton, new_fold_scratch

        control_step_triton(index, gate_score, control,
                            new_fold_scratch(control) if scratch is None else scratch)
    elif tokens:
        control_step_torch(index, gate_score, control, tokens)


def control_step_torch(index: torch.Tensor, gate_score: torch.Tensor, control: torch.Tensor,
                       tokens: int) -> None:
    """Plain torch version of :func:`control_step` (the CPU implementation).

    For each built-in row ``k`` and its tokens ``t`` of the step (in order): ``latch``:
    count += #(score > P1, or gate > 0.5 when P1 is NaN), floor = 1 once count >= P0;
    ``hysteresis``: scale = 1 if the last token with score > P0 comes after the last with
    score < P1, 0 if the other way round (unchanged if neither); ``proportional``: scale =
    P0 * clamp(score of the last token - P1, 0, P2) (unchanged on NaN); ``budget``: count +=
    #(gate > 0.5), scale = 0 once count >= P0."""
    k = index[INDEX_CONTROL, :tokens].to(torch.long)
    t = (k != 0).nonzero().squeeze(1)
    if t.numel() == 0:
        return
    k = k.index_select(0, t)
    gate, score = gate_score[GATE].index_select(0, t), gate_score[SCORE].index_select(0, t)
    row = control.index_select(0, k)
    kind = row[:, CTL_KIND]
    p0, p1 = row[:, CTL_P0], row[:, CTL_P1]
    n = control.shape[0]

    def per_row(values: torch.Tensor, reduce: str, init: float) -> torch.Tensor:
        out = torch.full((n,), init, dtype=values.dtype)
        return out.scatter_reduce(0, k, values, reduce=reduce, include_self=True)

    above = torch.where(torch.isnan(p1), gate > 0.5, score > p1)
    counted = torch.where(kind == KIND_LATCH, above, gate > 0.5) & (
        (kind == KIND_LATCH) | (kind == KIND_BUDGET))
    count = control[:, CTL_COUNT] + per_row(counted.to(torch.float32), "sum", 0.0)
    order = torch.arange(t.numel(), dtype=torch.float32)
    last = per_row(order, "amax", -1.0)
    last_on = per_row(torch.where(score > p0, order, -1.0), "amax", -1.0)
    last_off = per_row(torch.where(score < p1, order, -1.0), "amax", -1.0)
    kinds = control[:, CTL_KIND]
    seen = last >= 0
    s_last = score.new_zeros(n)
    s_last[seen] = score[last[seen].to(torch.long)]
    floor, scale = control[:, CTL_FLOOR].clone(), control[:, CTL_SCALE].clone()
    latch = seen & (kinds == KIND_LATCH)
    floor = torch.where(latch & (count >= control[:, CTL_P0]), 1.0, floor)
    hyst = seen & (kinds == KIND_HYSTERESIS)
    scale = torch.where(hyst & (last_on > last_off), 1.0, scale)
    scale = torch.where(hyst & (last_off > last_on), 0.0, scale)
    prop = seen & (kinds == KIND_PROPORTIONAL) & ~torch.isnan(s_last)
    target = control[:, CTL_P0] * torch.clamp(
        torch.minimum(s_last - control[:, CTL_P1], control[:, CTL_P2]), min=0.0)
    scale = torch.where(prop, target, scale)
    budget = seen & (kinds == KIND_BUDGET)
    scale = torch.where(budget & (count >= control[:, CTL_P0]), 0.0, scale)
    counts = seen & ((kinds == KIND_LATCH) | (kinds == KIND_BUDGET))
    control[:, CTL_COUNT] = torch.where(counts, count, control[:, CTL_COUNT])
    control[:, CTL_FLOOR] = floor
    control[:, CTL_SCALE] = scale


def stream_limit(dtype: torch.dtype) -> float:
    """Largest magnitude a steered element may have (see the module docstring)."""
    return min(STREAM_ABS_LIMIT, float(torch.finfo(dtype).max))


@torch.library.custom_op(f"{OP_NAMESPACE}::steer", mutates_args=(), schema=STEER_SCHEMA)
def steer(x: torch.Tensor, h: torch.Tensor | None, *args) -> torch.Tensor:
    """Capture + monitor + static + gated steering of one site (see the module docstring):
    ``steer(x, h, *buffers, site)`` with ``buffers`` a :class:`SteerBuffers`."""
    *buffers, site = args
    b = SteerBuffers(*buffers)
    tokens = x.shape[0]
    if b.index.shape[-1] < tokens or b.gate_score.shape[-1] < tokens:
        raise ValueError(f"dynsteer::steer: {tokens} tokens, but index {tuple(b.index.shape)} "
                         f"and gate_score {tuple(b.gate_score.shape)}")
    if x.is_cuda:
        from .kernels.steer import steer_triton

        return steer_triton(x, h, b, site, stream_limit(x.dtype))
    return steer_torch(x, h, b, site)


@steer.register_fake
def _steer_fake(x, h, *args):
    return torch.empty_like(x)


@torch.library.custom_op(f"{OP_NAMESPACE}::steer_norm", mutates_args=(),
                         schema=STEER_NORM_SCHEMA)
def steer_norm(x: torch.Tensor, h: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """A site and the fused add + RMSNorm after it, as one op: ``steer(x, h, ...)`` followed
    by vLLM's ``fused_add_rms_norm(h, steered x, weight, eps)``; returns ``(normed, stream)``,
    the norm's ``(hidden_states, residual)``. ``steer_norm(x, h, *buffers, site, weight,
    eps, monitor, site_bit)``; on CUDA a token whose entry lacks ``site_bit`` (when nonzero)
    reads no row here, as at a fused site (its row has no contents at this site's group).

    Why: a site fused by Inductor into the norm's looped kernel (:func:`steer_add`) adds the
    per-token index read, and stores the steered stream between the norm's two loops to read
    it back; on CUDA this is one Triton program per token that loads the stream, ``h``, the
    weight and the token's index in one round trip, reads no row for an unsteered token, and
    normalizes the row from registers (``kernels.steer_norm._steer_norm_kernel``). Engines
    with projection slots (``max_projections``) keep the unfused form (see
    :meth:`.sites.SiteOp.fuses_norm`)."""
    *buffers, site, weight, eps, monitor, site_bit = args
    b = SteerBuffers(*buffers)
    if x.is_cuda:
        from .kernels.steer_norm import steer_norm_triton

        return steer_norm_triton(x, h, b, site, stream_limit(x.dtype), weight, eps, monitor,
                                 site_bit)
    return rms_norm_after(steer(x, h, *b, site), h, weight, eps)


@steer_norm.register_fake
def _steer_norm_fake(x, h, *args):
    return torch.empty_like(x), torch.empty_like(x)


def rms_norm_after(steered: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's native fused add + RMSNorm of ``(h, steered)``: ``(normed, stream)``."""
    s = h.to(torch.float32) + steered.to(torch.float32)
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (n.to(weight.dtype) * weight).to(steered.dtype), s.to(steered.dtype)
