"""The steering op against a float64 reference, and its behaviour under torch.compile."""

from __future__ import annotations

import pytest
import torch

import dynsteer.engine_ext.ops  # noqa: F401  (registers torch.ops.dynsteer.*)


def reference(x, rows, table):
    return (x.double() + table.double()[rows.long()]).to(x.dtype)


@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steer_add_matches_float64(tokens, hidden, dtype):
    """Random rows (many mapped to row 0, which must leave tokens untouched)."""
    g = torch.Generator().manual_seed(tokens * hidden)
    table = torch.randn(5, hidden, generator=g) * 3
    table[0] = 0
    x = (torch.randn(tokens, hidden, generator=g) * 10).to(dtype)
    rows = torch.randint(0, 5, (tokens,), generator=g, dtype=torch.int32)
    out = torch.ops.dynsteer.steer_add(x, rows, table)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), reference(x, rows, table).double(), rtol=tol,
                               atol=tol)
    untouched = rows == 0
    assert torch.equal(out[untouched], x[untouched])


def test_fake_impl_shapes():
    """The fake impl lets the op be traced without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 8)
        out = torch.ops.dynsteer.steer_add(x, torch.zeros(3, dtype=torch.int32), torch.empty(2, 8))
    assert out.shape == (3, 8)


def test_compiled_graph_reads_buffers_in_place():
    """Under torch.compile (fullgraph, no breaks) new buffer contents apply without retracing."""
    table = torch.zeros(3, 4)
    rows = torch.zeros(8, dtype=torch.int32)

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x):
        return torch.ops.dynsteer.steer_add(x, rows[: x.shape[0]], table) * 2

    x = torch.ones(5, 4)
    assert torch.equal(f(x), 2 * x)
    table[2] = 1.5
    rows[1] = 2
    out = f(x)
    assert torch.equal(out[1], torch.full((4,), 5.0)) and torch.equal(out[0], 2 * x[0])
