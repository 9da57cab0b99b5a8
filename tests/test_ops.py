"""The fused steering op against a float64 reference, and its behaviour under torch.compile."""

from __future__ import annotations

import pytest
import torch

SITE = 3


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
    return x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score


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


CASES = [(1, 64), (7, 576), (33, 2048), (256, 4096), (4096, 64), (1024, 4096)]


@pytest.mark.parametrize(("tokens", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steer_matches_float64(tokens, hidden, dtype):
    """Monitor, gate and both tiers against float64; row-0 tokens are untouched."""
    args = make_inputs(tokens, hidden, dtype, seed=tokens * hidden)
    x, h, rows, probe_rows, table, dyn, flags, probes, params, gate, score = args
    want, gates, scores = reference(x, h, rows, probe_rows, table, dyn, flags, probes, params,
                                    gate)
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


def test_extreme_scores_saturate_without_nan():
    args = make_inputs(512, 256, torch.float32, seed=1, extreme=True)
    out = torch.ops.dynsteer.steer(*args, SITE)
    gate = args[9]
    assert torch.isfinite(out).all() and torch.isfinite(gate).all()
    assert ((gate >= 0) & (gate <= 1)).all()


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
    x0, h0, rows, probe_rows, table, dyn, flags, probes, params, gate, score = make_inputs(
        8, 16, torch.float32, seed=5)
    rows.zero_()
    probe_rows.zero_()

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x, h):
        n = x.shape[0]
        y = torch.ops.dynsteer.steer(x, h, rows[:n], probe_rows[:n], table, dyn, flags, probes,
                                     params, gate, score, SITE)
        return torch.ops.dynsteer.steer(y * 1.0, None, rows[:n], probe_rows[:n], table, dyn,
                                        flags, probes, params, gate, score, SITE + 7)

    x, h = x0[:5], h0[:5]
    assert torch.equal(f(x, h), x)
    rows[1] = 2  # dynamic-only row: only the gate decides
    probe_rows[1] = 1
    out = f(x, h)
    s = ((x[1] + h[1]) * probes[1]).sum()
    g = torch.sigmoid(params[1, 1] * (s - params[1, 0]))
    torch.testing.assert_close(out[1], x[1] + 2 * g * dyn[2], rtol=1e-5, atol=1e-4)
    assert torch.equal(out[0], x[0])
