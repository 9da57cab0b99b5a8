"""The fused steering op against a float64 reference, and its behaviour under torch.compile."""

from __future__ import annotations

import pytest
import torch

from dynsteer.engine_ext.worker import ops  # defines torch.ops.dynsteer.steer

SITE = 3
LANE = 2
SENTINEL = -1e6
"""What capture rows hold before the op: rows the op must not write keep it."""


def make_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, extreme: bool = False):
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
    rows = torch.randint(0, rows_n, (tokens,), generator=g, dtype=torch.int32)
    probe_rows = torch.randint(0, probes_n, (tokens,), generator=g, dtype=torch.int32)
    gate = torch.rand(tokens + 3, generator=g)  # stale values from "an earlier site"
    score = torch.zeros(tokens + 3)
    capacity = tokens + 5
    capture = torch.full((3, capacity + 1, hidden), SENTINEL)
    capture_rows = (torch.randperm(capacity, generator=g)[:tokens] + 1).to(torch.int32)
    capture_rows[torch.rand(tokens, generator=g) < 0.5] = 0  # about half the tokens captured
    site_lane = torch.full((SITE + 2,), -1, dtype=torch.int32)
    site_lane[SITE] = LANE
    site_lane[SITE + 1] = 0  # another site's lane: not this op's business
    return (x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score, capture_rows,
            capture, site_lane)


def reference(x, h, rows, probe_rows, table, dyn, flags, probes, params, gate):
    """float64 math, written independently of the op."""
    out = x.double().clone()
    gates, scores = gate.double().clone(), torch.full_like(gate.double(), float("nan"))
    for t in range(x.shape[0]):
        p = int(probe_rows[t])
        if p and int(params[p, 2]) == SITE:
            s = ((x[t].double() + h[t].double()) * probes[p].double()).sum()
            z = params[p, 1].double() * (s - params[p, 0].double())
            gates[t] = torch.sigmoid(z)
            scores[t] = s
        r = int(rows[t])
        out[t] += table[r].double() + gates[t] * dyn[r].double()
    return out, gates, scores


def capture_reference(x, h, capture_rows, capture, site_lane):
    """float64 capture buffer after the op: the pre-steering stream of each captured token."""
    want = capture.double().clone()
    lane = int(site_lane[SITE])
    for t in range(x.shape[0]):
        c = int(capture_rows[t])
        if c and lane >= 0:
            want[lane, c] = x[t].double() + (h[t].double() if h is not None else 0)
    return want


CASES = [(1, 64), (7, 576), (33, 2048), (256, 4096), (4096, 64), (1024, 4096)]


@pytest.mark.parametrize(("tokens", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steer_matches_float64(tokens, hidden, dtype):
    """Monitor, gate and both tiers against float64; row-0 tokens are untouched."""
    args = make_inputs(tokens, hidden, dtype, seed=tokens * hidden)
    x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score = args[:11]
    want, gates, scores = reference(x, h, rows, probe_rows, table, dyn, flags, probes, params,
                                    gate)
    want_capture = capture_reference(x, h, *args[11:])
    out = torch.ops.dynsteer.steer(*args, SITE)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=tol, atol=tol * 10)
    monitored = ~torch.isnan(scores[:tokens])
    torch.testing.assert_close(gate[:tokens][monitored].double(), gates[:tokens][monitored],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(score[:tokens][monitored].double(), scores[:tokens][monitored],
                               rtol=1e-4, atol=1e-3)
    untouched = rows == 0
    assert torch.equal(out[untouched], x[untouched])
    torch.testing.assert_close(args[12].double(), want_capture, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("with_h", [True, False])
def test_capture_stores_the_pre_steering_stream(with_h):
    """Captured tokens store x + h (x alone without h) before steering, at this site's lane
    only; other rows, other lanes and uncaptured tokens stay untouched."""
    args = list(make_inputs(40, 96, torch.bfloat16, seed=11))
    if not with_h:
        args[1] = None
    capture_rows, capture, site_lane = args[11:]
    want = capture_reference(args[0], args[1], capture_rows, capture, site_lane)
    torch.ops.dynsteer.steer(*args, SITE)
    assert (capture_rows != 0).any() and (capture_rows == 0).any()
    torch.testing.assert_close(capture.double(), want, rtol=0, atol=0)  # bf16 sums are exact
    written = capture[LANE][capture_rows[capture_rows != 0].long()]
    assert (written != SENTINEL).all()
    assert (capture[[0, 1]] == SENTINEL).all()


def test_site_without_lane_captures_nothing():
    args = make_inputs(16, 64, torch.float32, seed=2)
    args[13][SITE] = -1
    torch.ops.dynsteer.steer(*args, SITE)
    assert (args[12] == SENTINEL).all()


def test_extreme_scores_saturate_without_nan():
    args = make_inputs(512, 256, torch.float32, seed=1, extreme=True)
    out = torch.ops.dynsteer.steer(*args, SITE)
    gate = args[9]
    assert torch.isfinite(out).all() and torch.isfinite(gate).all()
    assert ((gate >= 0) & (gate <= 1)).all()


def poison_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """Inputs whose rows overflow on purpose: row 1 holds inf, NaN and 1e30 (finite but far
    past the stream limit), probe 1 scores NaN; other rows are ordinary."""
    args = list(make_inputs(tokens, hidden, dtype, seed))
    table, probes = args[4], args[7]
    table[1, 0], table[1, 1], table[1, 2:] = float("inf"), float("nan"), 1e30
    probes[1, 0], probes[1, 1] = float("inf"), float("-inf")  # score inf - inf = NaN
    args[0][:, :2], args[1][:, :2] = 1, 0
    return args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_overflowing_rows_leave_the_stream_finite(dtype):
    """The op never writes NaN, inf or a value past the stream limit: such elements keep their
    unsteered value, other elements and rows are steered as usual, NaN gates count as 0."""
    args = poison_inputs(64, 128, dtype, seed=3)
    x, rows = args[0], args[2]
    out = torch.ops.dynsteer.steer(*args, SITE)
    assert torch.isfinite(out).all()
    assert (out.float().abs() <= ops.stream_limit(dtype)).all()
    poisoned = rows == 1
    assert poisoned.any()
    assert torch.equal(out[poisoned], x[poisoned])  # every element of row 1 overflowed
    gate, probe_rows = args[9][:64], args[3]
    nan_scored = probe_rows == 1
    assert nan_scored.any() and torch.isnan(args[10][:64][nan_scored]).all()
    assert (gate[nan_scored] == 0).all()
    fine = rows == 3
    assert fine.any() and not torch.equal(out[fine], x[fine])


def test_fake_impl_shapes():
    """The fake impl lets the op be traced without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = make_inputs(3, 8, torch.float32, seed=0)
        out = torch.ops.dynsteer.steer(*args, SITE)
    assert out.shape == (3, 8)


def test_compiled_graph_reads_buffers_in_place():
    """Under torch.compile (fullgraph) new buffer contents apply without retracing, and a
    gate written at the monitor site is read by a later site in the same graph."""
    (x0, h0, rows, probe_rows, table, dyn, flags, probes, params, gate, score, capture_rows,
     capture, site_lane) = make_inputs(8, 16, torch.float32, seed=5)
    rows.zero_()
    probe_rows.zero_()
    capture_rows.zero_()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x, h):
        n = x.shape[0]
        y = torch.ops.dynsteer.steer(x, h, rows[:n], probe_rows[:n], table, dyn, flags, probes,
                                     params, gate, score, capture_rows[:n], capture, site_lane,
                                     SITE)
        return torch.ops.dynsteer.steer(y * 1.0, None, rows[:n], probe_rows[:n], table, dyn,
                                        flags, probes, params, gate, score, capture_rows[:n],
                                        capture, site_lane, SITE + 1)

    x, h = x0[:5], h0[:5]
    assert torch.equal(f(x, h), x)
    assert (capture == SENTINEL).all()
    rows[1] = 2  # dynamic-only row: only the gate decides
    probe_rows[1] = 1
    out = f(x, h)
    s = ((x[1] + h[1]) * probes[1]).sum()
    g = torch.sigmoid(params[1, 1] * (s - params[1, 0]))
    torch.testing.assert_close(out[1], x[1] + 2 * g * dyn[2], rtol=1e-5, atol=1e-4)
    assert torch.equal(out[0], x[0])
    capture_rows[3] = 4  # captured at both sites: the stream before each site's own steering
    out = f(x, h)
    torch.testing.assert_close(capture[LANE, 4], x[3] + h[3])
    torch.testing.assert_close(capture[0, 4], out[3])  # site SITE + 1 has lane 0; no steering
