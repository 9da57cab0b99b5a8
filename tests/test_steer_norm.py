"""``dynsteer::steer_norm`` (a site and the fused add + RMSNorm after it, one op) against
float64: the torch implementation, and the CUDA kernel's code in Triton's interpreter (the GPU
check and ``test_ops``'s CUDA cases run it compiled)."""

from __future__ import annotations

import pytest
import torch
from test_ops import DEVICES, SITE, make_inputs, on, reference
from triton_interpreter import require_interpreter, run_interpreted

from dynsteer.engine_ext.worker import layout, ops

EPS = 1e-5


def without_projections(b: ops.SteerBuffers) -> ops.SteerBuffers:
    """``b`` as an engine without projection slots has it (what the fused kernel takes)."""
    rows, hidden = b.table.shape
    return b._replace(flags=b.flags & ~layout.PROJECT_FLAG,
                      proj_dir=torch.zeros(rows, 0, hidden),
                      proj_par=torch.zeros(rows, 0, layout.PROJ_PARAMS),
                      proj_gram=torch.zeros(rows, 0, 0))


def inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int, monitor: bool = True):
    """``(x, h, buffers, weight)``, no projection slots; the weight is the model's dtype.
    Token 0 is steered by both tiers and monitored here (so one token checks everything);
    ``monitor`` False: no token is monitored (a site without probes; tokens are still
    captured, which such a site never sees, to show that the kernel then looks at neither)."""
    x, h, b = make_inputs(tokens, hidden, dtype, seed)
    b.index[layout.INDEX_PROBE, 0], b.index[layout.INDEX_ROW, 0] = 1, 3
    if not monitor:
        b.index[layout.INDEX_PROBE] = 0
    weight = (1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return x, h, without_projections(b), weight.to(dtype)


def norm_reference(x, h, b: ops.SteerBuffers, weight: torch.Tensor):
    """float64 ``(normed, stream, gates, scores)``: the site's steered ``x``, rounded to its
    dtype as the unfused site hands it on, then RMSNorm of ``h + steered``."""
    steered, gates, scores = reference(x, h, b)
    stream = h.double() + steered.to(x.dtype).double()
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + EPS)
    return normed * weight.double(), stream, gates, scores


def check(got_normed, got_stream, got_gate_score, want, tokens: int, dtype,
          monitored: bool = True) -> None:
    normed, stream, gates, scores = want
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # The stream's elements are ~10-30 (bf16 steps of 0.06-0.12 before h is added).
    torch.testing.assert_close(got_stream.double(), stream.to(dtype).double(),
                               rtol=tol, atol=tol * 10)
    torch.testing.assert_close(got_normed.double(), normed.to(dtype).double(),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(got_gate_score[layout.GATE, :tokens].double(), gates[:tokens],
                               rtol=1e-4, atol=1e-5)
    assert bool((~torch.isnan(scores[:tokens])).any()) is monitored


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 576), (33, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_steer_norm_matches_float64(tokens, hidden, dtype, device):
    """Monitor, gate, both tiers and the norm after them; the stream it returns is the
    residual the next layer adds to."""
    x, h, b, weight = inputs(tokens, hidden, dtype, seed=tokens + hidden)
    want = norm_reference(x, h, b, weight)
    xd, hd, bd = on(device, x, h, b)
    normed, stream = torch.ops.dynsteer.steer_norm(xd, hd, *bd, SITE, weight.to(device), EPS,
                                                    True, 0)
    check(normed.cpu(), stream.cpu(), bd.gate_score.cpu(), want, tokens, dtype)


INTERPRETED_CASES = ((1, 64, "float32", True, False), (5, 96, "float32", True, False),
                     (3, 64, "bfloat16", True, False), (5, 96, "float32", False, False),
                     (6, 64, "float32", True, True))
"""``(tokens, hidden, dtype, monitor, groups)``: a row narrower than its block (96 of 128),
bfloat16 rounding, a site compiled without its probe and capture code, and site groups."""
GROUP_BIT = layout.site_bit(3, 8)
"""The site's group bit in the ``groups`` case: every token's entry carries it but token 1's
(steered by row 3, which then steers nothing at this site)."""


def grouped(b: ops.SteerBuffers) -> ops.SteerBuffers:
    """``b`` with site-group bits in the entries (see GROUP_BIT)."""
    b.index[layout.INDEX_ROW] |= GROUP_BIT
    b.index[layout.INDEX_ROW, 1] = 3
    return b


def ungrouped(b: ops.SteerBuffers) -> ops.SteerBuffers:
    """What ``grouped(b)`` steers here, as plain rows: token 1 unsteered."""
    b = ops.SteerBuffers(*(t.clone() for t in b))
    b.index[layout.INDEX_ROW] &= layout.ROW_MASK
    b.index[layout.INDEX_ROW, 1] = 0
    return b

INTERPRETED = """
import json
import torch
from test_steer_norm import EPS, GROUP_BIT, INTERPRETED_CASES, grouped, inputs
from test_ops import SENTINEL, SITE
from dynsteer.engine_ext.worker import ops
from dynsteer.engine_ext.worker.kernels import steer_norm as tk
out = []
for tokens, hidden, dtype, monitor, groups in INTERPRETED_CASES:
    x, h, b, weight = inputs(tokens, hidden, getattr(torch, dtype), tokens + hidden, monitor)
    if groups:
        b = grouped(b)
    normed, stream = tk.steer_norm_triton(x, h, b, SITE, ops.stream_limit(x.dtype), weight, EPS,
                                          monitor, GROUP_BIT if groups else 0)
    out.append([normed.float().tolist(), stream.float().tolist(), b.gate_score.tolist(),
                (b.capture == SENTINEL).all().item()])
print(json.dumps(out))
"""


def test_steer_norm_kernel_matches_float64_in_the_interpreter():
    """The CUDA kernel's code (the ``NORM`` form of ``_steer_kernel``), run by Triton's CPU
    interpreter, against float64; compiled without the monitor, it captures nothing; with a
    site bit, a token whose entry lacks it reads no row."""
    require_interpreter("test_steer_norm_matches_float64 runs the kernel compiled")
    got = run_interpreted(INTERPRETED)
    for (tokens, hidden, dtype, monitor, groups), (normed, stream, gate_score, untouched) in zip(
            INTERPRETED_CASES, got, strict=True):
        x, h, b, weight = inputs(tokens, hidden, getattr(torch, dtype), tokens + hidden,
                                 monitor)
        want = norm_reference(x, h, ungrouped(grouped(b)) if groups else b, weight)
        check(torch.tensor(normed), torch.tensor(stream), torch.tensor(gate_score), want,
              tokens, x.dtype, monitored=monitor)
        assert untouched is not monitor  # captured tokens overwrite SENTINEL


def test_steer_norm_kernel_refuses_projection_slots():
    """Engines with projection slots keep the unfused site (SiteOp.fuses_norm); the kernel's
    launcher says so if it is called anyway."""
    pytest.importorskip("triton")
    from dynsteer.engine_ext.worker.kernels import steer_norm as tk

    x, h, b = make_inputs(2, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="2 projection slots"):
        tk.steer_norm_triton(x, h, b, SITE, 1e4, torch.ones(64), EPS)


def test_fake_impl_shapes():
    """The fake impl lets torch.compile trace the op without running it."""
    x, h, b, weight = inputs(3, 64, torch.bfloat16, seed=1)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fh = mode.from_tensor(x), mode.from_tensor(h)
        fb = [mode.from_tensor(t) for t in b]
        normed, stream = torch.ops.dynsteer.steer_norm(fx, fh, *fb, SITE,
                                                       mode.from_tensor(weight), EPS, False, 0)
    assert normed.shape == stream.shape == x.shape
    assert normed.dtype == stream.dtype == x.dtype
