"""The fused steering op against a float64 reference, and its behaviour under torch.compile."""

from __future__ import annotations

import pytest
import torch

from dynsteer.engine_ext.worker import (
    layout,
    ops,  # defines torch.ops.dynsteer.steer
)

SITE = 3
LANE = 2
SENTINEL = -1e6
"""What capture rows hold before the op: rows the op must not write keep it."""


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
"""CUDA runs the Triton kernel against the same float64 reference (on a GPU machine)."""


def make_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, extreme: bool = False):
    """``(x, h, buffers)``. The per-token buffers have 3 columns past the step's tokens, as the
    worker's do (``max_tokens`` wide): they point at a monitored probe and unused capture rows,
    so an op that read past ``x.shape[0]`` would write where the checks see it."""
    g = torch.Generator().manual_seed(seed)
    rows_n, probes_n = 5, 4
    table = torch.randn(rows_n, hidden, generator=g) * 3
    dyn = torch.randn(rows_n, hidden, generator=g) * 3
    flags = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    table[0] = dyn[0] = 0
    table[2] = 0  # dynamic-only row
    dyn[1] = 0  # static-only row
    probes = torch.randn(probes_n, hidden, generator=g) / hidden**0.5
    probes[0] = 0
    params = torch.tensor([[0, 0, 0], [0.1, 2.0, SITE], [-0.3, 0.5, SITE], [0.0, 1.0, SITE + 1]])
    if extreme:
        params[1, 1] = 1e6  # sigmoid saturates: gates exactly 0 or 1, never NaN
        probes[2] *= 1e4
    x = (torch.randn(tokens, hidden, generator=g) * 10).to(dtype)
    h = (torch.randn(tokens, hidden, generator=g) * 10).to(dtype)
    width = tokens + 3
    index = torch.zeros(layout.INDEX_ROWS, width, dtype=torch.int32)
    rows, probe_rows, capture_rows = (index[i] for i in (layout.INDEX_ROW, layout.INDEX_PROBE,
                                                         layout.INDEX_CAPTURE))
    rows[:tokens] = torch.randint(0, rows_n, (tokens,), generator=g, dtype=torch.int32)
    probe_rows[:tokens] = torch.randint(0, probes_n, (tokens,), generator=g, dtype=torch.int32)
    gate_score = torch.zeros(2, width)
    gate_score[layout.GATE] = torch.rand(width, generator=g)  # stale values from "an earlier site"
    capacity = tokens + 5
    capture = torch.full((3, capacity + 1, hidden), SENTINEL)
    capture_rows[:] = (torch.randperm(capacity, generator=g)[:width] + 1).to(torch.int32)
    capture_rows[:tokens][torch.rand(tokens, generator=g) < 0.5] = 0  # about half captured
    # Past the step's tokens: steered rows, a probe monitored here, capture rows no token uses.
    rows[tokens:] = torch.randint(1, rows_n, (width - tokens,), generator=g, dtype=torch.int32)
    probe_rows[tokens:] = 1
    site_lane = torch.full((SITE + 2,), -1, dtype=torch.int32)
    site_lane[SITE] = LANE
    site_lane[SITE + 1] = 0  # another site's lane: not this op's business
    # Controller rows: none, a latched one, a scaled one, a switched-off one.
    control = torch.zeros(4, layout.CTL_COLS)
    control[1:, layout.CTL_FLOOR] = torch.tensor([1.0, 0.0, 0.3])
    control[1:, layout.CTL_SCALE] = torch.tensor([1.0, 0.4, 0.0])
    index[layout.INDEX_CONTROL, :tokens] = torch.randint(0, 4, (tokens,), generator=g,
                                                      dtype=torch.int32)
    # Projection slots (2): rows 2 and 3 have two, row 4 one (its second slot unused); row 3's
    # second is a norm-matched add.
    flags[2:] |= layout.PROJECT_FLAG
    proj_dir = torch.randn(rows_n, 2, hidden, generator=g, dtype=torch.float64)
    proj_dir /= proj_dir.norm(dim=-1, keepdim=True)
    proj_dir[:2] = 0
    proj_dir[4, 1] = 0
    proj_par = torch.zeros(rows_n, 2, layout.PROJ_PARAMS)
    proj_par[2:] = torch.randn(rows_n - 2, 2, layout.PROJ_PARAMS, generator=g)
    proj_par[2:, :, layout.PROJ_VALUE] *= 5
    proj_par[:, :, layout.PROJ_NORM] = 0
    proj_par[3, 1, layout.PROJ_NORM] = 1  # row 3's second slot: a norm-matched add
    proj_par[4, 1] = 0
    proj_gram = (proj_dir @ proj_dir.transpose(1, 2)).float()
    return x, h, ops.SteerBuffers(index=index, gate_score=gate_score, table=table, dyn=dyn,
                                  flags=flags, probes=probes, params=params, capture=capture,
                                  site_lane=site_lane, control=control,
                                  proj_dir=proj_dir.float(), proj_par=proj_par,
                                  proj_gram=proj_gram)


def projection_reference(stream: torch.Tensor, gate: float, r: int, b: ops.SteerBuffers
                         ) -> torch.Tensor:
    """float64: what row ``r``'s projection slots add to one token's ``stream``, applying them
    one after the other to the stream as each left it (no Gram matrix)."""
    z = stream.double().clone()
    if not int(b.flags[r]) & layout.PROJECT_FLAG:
        return torch.zeros_like(z)
    for d in range(b.proj_dir.shape[1]):
        direction = b.proj_dir[r, d].double()
        static, gated, value, matched = (float(v) for v in b.proj_par[r, d])
        if matched:  # a norm-matched add: the incoming stream's norm along the direction
            z = z + (static + gate * gated) * stream.double().norm() * direction
        else:
            z = z + (static + gate * gated) * (value - z @ direction) * direction
    return z - stream.double()


def on(device: str, x, h, b: ops.SteerBuffers):
    """The same inputs on ``device`` (copies on another device)."""
    return (x.to(device), None if h is None else h.to(device),
            ops.SteerBuffers(*(t.to(device) for t in b)))


def steer(x, h, b: ops.SteerBuffers, site: int = SITE) -> torch.Tensor:
    return torch.ops.dynsteer.steer(x, h, *b, site)


def reference(x, h, b: ops.SteerBuffers):
    """float64 math, written independently of the op (call it before the op: the op writes
    ``gate_score`` in place)."""
    tokens = x.shape[0]
    rows, probe_rows = b.index[layout.INDEX_ROW, :tokens], b.index[layout.INDEX_PROBE, :tokens]
    table, dyn, probes, params = b.table, b.dyn, b.probes, b.params
    out = x.double().clone()
    gate = b.gate_score[layout.GATE]
    gates, scores = gate.double().clone(), torch.full_like(gate.double(), float("nan"))
    for t in range(tokens):
        p = int(probe_rows[t])
        if p and int(params[p, 2]) == SITE:
            s = ((x[t].double() + h[t].double()) * probes[p].double()).sum()
            z = params[p, 1].double() * (s - params[p, 0].double())
            gates[t] = torch.sigmoid(z)
            k = int(b.index[layout.INDEX_CONTROL, t])
            if k:  # the controller's floor and scale
                floor, scale = (float(b.control[k, c])
                                for c in (layout.CTL_FLOOR, layout.CTL_SCALE))
                gates[t] = max(float(gates[t]), floor) * scale
            scores[t] = s
        r = int(rows[t])
        stream = x[t].double() + (h[t].double() if h is not None else 0)
        out[t] += projection_reference(stream, float(gates[t]), r, b)
        out[t] += table[r].double() + gates[t] * dyn[r].double()
    return out, gates, scores


def capture_reference(x, h, b: ops.SteerBuffers):
    """float64 capture buffer after the op: the pre-steering stream of each captured token."""
    want = b.capture.double().clone()
    lane = int(b.site_lane[SITE])
    for t in range(x.shape[0]):
        c = int(b.index[layout.INDEX_CAPTURE, t])
        if c and lane >= 0:
            want[lane, c] = x[t].double() + (h[t].double() if h is not None else 0)
    return want


CASES = [(1, 64), (7, 576), (33, 2048), (256, 4096), (4096, 64), (1024, 4096)]


@pytest.mark.parametrize(("tokens", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_steer_matches_float64(tokens, hidden, dtype, device):
    """Monitor, gate and both tiers against float64; row-0 tokens are untouched; columns of the
    per-token buffers past the step's tokens are neither read nor written. The op reads a
    token's row under the site-group bits of its index entry (they are for fused sites)."""
    x, h, b = make_inputs(tokens, hidden, dtype, seed=tokens * hidden)
    want, gates, scores = reference(x, h, b)
    want_capture = capture_reference(x, h, b)
    untouched = b.index[layout.INDEX_ROW, :tokens] == 0
    b.index[layout.INDEX_ROW] |= layout.site_bit(tokens % 8, 8)
    stale = b.gate_score[:, tokens:].clone()
    xd, hd, bd = on(device, x, h, b)
    out = steer(xd, hd, bd).cpu()
    gate_score = bd.gate_score.cpu()
    gate, score = gate_score[layout.GATE], gate_score[layout.SCORE]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=tol, atol=tol * 10)
    monitored = ~torch.isnan(scores[:tokens])
    torch.testing.assert_close(gate[:tokens][monitored].double(), gates[:tokens][monitored],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(score[:tokens][monitored].double(), scores[:tokens][monitored],
                               rtol=1e-4, atol=1e-3)
    assert torch.equal(out[untouched], x[untouched])
    torch.testing.assert_close(bd.capture.cpu().double(), want_capture, rtol=1e-6, atol=1e-5)
    assert torch.equal(gate_score[:, tokens:], stale)


INTERPRETED_CASES = [(7, 576, "float32", True), (5, 64, "bfloat16", False),
                     (3, 1100, "float32", True)]
"""(tokens, hidden, dtype, with h): two projection slots each (:func:`make_inputs`), which cap
the kernel's block at 1024, so hidden 1100 takes two turns of its row loops."""

INTERPRETED = """
import json
import torch
from test_ops import INTERPRETED_CASES, SITE, make_inputs
from dynsteer.engine_ext.worker import layout, ops
from dynsteer.engine_ext.worker.kernels import steer as tk
out = []
for tokens, hidden, dtype, with_h in INTERPRETED_CASES:
    x, h, b = make_inputs(tokens, hidden, getattr(torch, dtype), seed=tokens * hidden)
    if not with_h:
        b.index[layout.INDEX_PROBE] = 0
    b.index[layout.INDEX_ROW] |= layout.site_bit(tokens % 8, 8)
    steered = tk.steer_triton(x, h if with_h else None, b, SITE, ops.stream_limit(x.dtype))
    out.append([steered.float().tolist(), b.gate_score.tolist(), b.capture.tolist()])
print(json.dumps(out))
"""


def test_steer_kernel_matches_float64_in_the_interpreter():
    """The CUDA kernel (``_steer_kernel``), run by Triton's CPU interpreter, against float64:
    monitor, gate, both tiers, two projection slots and capture, with and without ``h``."""
    from triton_interpreter import require_interpreter, run_interpreted

    require_interpreter("test_steer_matches_float64 runs the kernel compiled")

    got = run_interpreted(INTERPRETED)
    for (tokens, hidden, dtype, with_h), (out, gate_score, capture) in zip(
            INTERPRETED_CASES, got, strict=True):
        x, h, b = make_inputs(tokens, hidden, getattr(torch, dtype), seed=tokens * hidden)
        h = h if with_h else None
        if h is None:  # as the script: no monitor without h (the reference's probe reads x + h)
            b.index[layout.INDEX_PROBE] = 0
        want, gates, scores = reference(x, h, b)
        tol = 1e-4 if x.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(torch.tensor(out).double(), want.to(x.dtype).double(),
                                   rtol=tol, atol=tol * 10)
        monitored = ~torch.isnan(scores[:tokens])
        assert bool(monitored.any()) is with_h
        torch.testing.assert_close(torch.tensor(gate_score)[layout.GATE, :tokens][monitored]
                                   .double(), gates[:tokens][monitored], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(capture).double(), capture_reference(x, h, b),
                                   rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("with_h", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_capture_stores_the_pre_steering_stream(with_h, device):
    """Captured tokens store x + h (x alone without h) before steering, at this site's lane
    only; other rows, other lanes and uncaptured tokens stay untouched."""
    x, h, b = make_inputs(40, 96, torch.bfloat16, seed=11)
    if not with_h:
        h = None
    want = capture_reference(x, h, b)
    xd, hd, bd = on(device, x, h, b)
    steer(xd, hd, bd)
    capture, capture_rows = bd.capture.cpu(), b.index[layout.INDEX_CAPTURE, :40]
    assert (capture_rows != 0).any() and (capture_rows == 0).any()
    torch.testing.assert_close(capture.double(), want, rtol=0, atol=0)  # bf16 sums are exact
    written = capture[LANE][capture_rows[capture_rows != 0].long()]
    assert (written != SENTINEL).all()
    assert (capture[[0, 1]] == SENTINEL).all()


def test_site_without_lane_captures_nothing():
    x, h, b = make_inputs(16, 64, torch.float32, seed=2)
    b.site_lane[SITE] = -1
    steer(x, h, b)
    assert (b.capture == SENTINEL).all()


def test_extreme_scores_saturate_without_nan():
    x, h, b = make_inputs(512, 256, torch.float32, seed=1, extreme=True)
    out = steer(x, h, b)
    gate = b.gate_score[layout.GATE]
    assert torch.isfinite(out).all() and torch.isfinite(gate).all()
    assert ((gate >= 0) & (gate <= 1)).all()


def poison_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """Inputs whose rows overflow on purpose: row 1 holds inf, NaN and 1e30 (finite but far
    past the stream limit), probe 1 scores NaN; other rows are ordinary."""
    x, h, b = make_inputs(tokens, hidden, dtype, seed)
    b.table[1, 0], b.table[1, 1], b.table[1, 2:] = float("inf"), float("nan"), 1e30
    b.probes[1, 0], b.probes[1, 1] = float("inf"), float("-inf")  # score inf - inf = NaN
    x[:, :2], h[:, :2] = 1, 0
    return x, h, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_overflowing_rows_leave_the_stream_finite(dtype, device):
    """The op never writes NaN, inf or a value past the stream limit: such elements keep their
    unsteered value, other elements and rows are steered as usual, NaN gates count as 0."""
    x, h, b = on(device, *poison_inputs(64, 128, dtype, seed=3))
    out = steer(x, h, b)
    assert torch.isfinite(out).all()
    assert (out.float().abs() <= ops.stream_limit(dtype)).all()
    rows, probe_rows = b.index[layout.INDEX_ROW, :64], b.index[layout.INDEX_PROBE, :64]
    poisoned = rows == 1
    assert poisoned.any()
    assert torch.equal(out[poisoned], x[poisoned])  # every element of row 1 overflowed
    gate, score = b.gate_score[layout.GATE, :64], b.gate_score[layout.SCORE, :64]
    nan_scored = probe_rows == 1
    assert nan_scored.any() and torch.isnan(score[nan_scored]).all()
    assert (gate[nan_scored] == 0).all()
    fine = rows == 3
    assert fine.any() and not torch.equal(out[fine], x[fine])


def test_fake_impl_shapes():
    """The fake impl lets the op be traced without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, h, b = make_inputs(3, 8, torch.float32, seed=0)
        out = steer(x, h, b)
    assert out.shape == (3, 8)


def test_schema_follows_the_buffers():
    """The op's arguments are x, h, the SteerBuffers fields in order, and the site."""
    schema = torch.ops.dynsteer.steer.default._schema
    assert [a.name for a in schema.arguments] == ["x", "h", *ops.SteerBuffers._fields, "site"]
    assert not any(a.alias_info for a in schema.arguments)  # nothing declared as mutated


def test_compiled_graph_reads_buffers_in_place():
    """Under torch.compile (fullgraph) the site ops (:class:`SiteOp`, whole per-token buffers)
    apply new buffer contents without retracing, and a gate written at the monitor site is read
    by later sites in the same graph: another monitor site's op and a site without monitor
    (the fused add on CUDA, the op elsewhere)."""
    from dynsteer.engine_ext.worker.sites import SiteBuffers, SiteOp

    x0, h0, b = make_inputs(8, 16, torch.float32, seed=5)
    b.flags.bitwise_and_(~layout.PROJECT_FLAG)  # adds only (projections: the float64 tests)
    b.index.zero_()
    rows, probe_rows, capture_rows = (b.index[i] for i in (layout.INDEX_ROW, layout.INDEX_PROBE,
                                                           layout.INDEX_CAPTURE))
    capture, dyn, probes, params = b.capture, b.dyn, b.probes, b.params
    sites = SITE + 2

    def site_op(position: int, monitor: bool) -> SiteOp:
        return SiteOp(SiteBuffers(position, monitor, layout.site_bit(position, sites), b))

    first, second = site_op(SITE, True), site_op(SITE + 1, True)
    fused = site_op(SITE - 1, False)  # no probe monitors here, no lane

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x, h):
        return fused(second(first(x, h) * 1.0) * 1.0)

    x, h = x0[:5], h0[:5]
    assert torch.equal(f(x, h), x)
    assert (capture == SENTINEL).all()
    rows[1] = layout.row_entry(2, range(sites), sites)  # dynamic-only row: only the gate decides
    probe_rows[1] = 1
    out = f(x, h)
    s = ((x[1] + h[1]) * probes[1]).sum()
    g = torch.sigmoid(params[1, 1] * (s - params[1, 0]))
    torch.testing.assert_close(out[1], x[1] + 3 * g * dyn[2], rtol=1e-5, atol=1e-4)
    assert torch.equal(out[0], x[0])
    capture_rows[3] = 4  # captured at both sites: the stream before each site's own steering
    out = f(x, h)
    torch.testing.assert_close(capture[LANE, 4], x[3] + h[3])
    torch.testing.assert_close(capture[0, 4], out[3])  # site SITE + 1 has lane 0; no steering


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (33, 2048), (1024, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_steer_add_matches_float64(tokens, hidden, dtype, device):
    """A site without monitor (:func:`ops.steer_add`): both tiers with the gate earlier sites
    wrote (closed, 0, on every third token), eager and compiled, against float64; an element
    the steering would push past the stream limit (or to NaN) keeps its value. Every fourth
    token's row steers another group of sites only (its entry lacks this site's bit): it is
    not steered here."""
    x, h, b = make_inputs(tokens, hidden, dtype, seed=tokens + hidden)
    b.table[3, 0] = float("inf")
    b.table[4, 1] = 2 * ops.stream_limit(dtype)
    b.gate_score[layout.GATE, ::3] = 0.0  # closed gates: the dynamic row adds 0
    here, elsewhere = layout.site_bit(3, 8), layout.site_bit(6, 8)
    entries = b.index[layout.INDEX_ROW]
    steered_here = torch.arange(entries.numel()) % 4 != 1
    rows = torch.where(steered_here, entries, 0)[:tokens].long()
    entries |= torch.where(steered_here, here, elsewhere).to(torch.int32)
    gate = b.gate_score[layout.GATE, :tokens, None].double()
    want = x.double() + b.table[rows].double() + gate * b.dyn[rows].double()
    for t in range(tokens):
        want[t] += projection_reference(x[t].double() + h[t].double(), float(gate[t]),
                                        int(rows[t]), b)
    over = ~(want.abs() <= ops.stream_limit(dtype))
    want[over] = x.double()[over]
    xd, hd, bd = on(device, x, h, b)
    args = (xd, hd, bd.index, bd.gate_score, bd.table, bd.dyn, bd.proj_dir, bd.proj_par,
            bd.proj_gram, here)
    compiled = torch.compile(ops.steer_add, fullgraph=True, dynamic=True)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 0.1}
    for out in (ops.steer_add(*args), compiled(*args)):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu().double(), want, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_steer_add_leaves_x_where_h_is_nan(device):
    """Where ``h`` is NaN the stream is NaN whatever a site adds: a fused site leaves ``x``
    there (what ties its arithmetic to ``h``, see ``ops._within_limit``) and steers every
    other element, eager and compiled."""
    x, h, b = make_inputs(4, 64, torch.float32, seed=11)
    b = b._replace(proj_dir=b.proj_dir[:, :0], proj_par=b.proj_par[:, :0],
                   proj_gram=b.proj_gram[:, :0, :0])  # no slots (they read the whole stream)
    here = layout.site_bit(0, 1)
    b.index[layout.INDEX_ROW] = 1 | here  # static-only row
    h[2, 5] = float("nan")
    want = x + b.table[1]
    want[2, 5] = x[2, 5]
    xd, hd, bd = on(device, x, h, b)
    args = (xd, hd, bd.index, bd.gate_score, bd.table, bd.dyn, bd.proj_dir, bd.proj_par,
            bd.proj_gram, here)
    compiled = torch.compile(ops.steer_add, fullgraph=True, dynamic=True)
    for out in (ops.steer_add(*args), compiled(*args)):
        torch.testing.assert_close(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_steer_add_without_site_groups_reads_plain_rows(device):
    """``site_bit`` 0 (engine option ``site_groups: false``, the form before the groups): the
    entries are plain rows, every steered token is steered at the site, and the site is not
    tied to ``h`` (a NaN there leaves the steered element as it is), eager and compiled."""
    x, h, b = make_inputs(4, 64, torch.float32, seed=12)
    b = b._replace(proj_dir=b.proj_dir[:, :0], proj_par=b.proj_par[:, :0],
                   proj_gram=b.proj_gram[:, :0, :0])
    b.index[layout.INDEX_ROW] = torch.tensor([1, 0, 1, 2] + [0] * (b.index.shape[1] - 4),
                                          dtype=torch.int32)
    b.gate_score[layout.GATE] = 0.5
    h[2, 5] = float("nan")
    rows = b.index[layout.INDEX_ROW, :4].long()
    want = x + b.table[rows] + 0.5 * b.dyn[rows]
    xd, hd, bd = on(device, x, h, b)
    args = (xd, hd, bd.index, bd.gate_score, bd.table, bd.dyn, bd.proj_dir, bd.proj_par,
            bd.proj_gram, 0)
    compiled = torch.compile(ops.steer_add, fullgraph=True, dynamic=True)
    for out in (ops.steer_add(*args), compiled(*args)):
        torch.testing.assert_close(out.cpu(), want)
