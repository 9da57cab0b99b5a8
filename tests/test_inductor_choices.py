"""``compat.inductor.install``: the reduction kernel a fused site is in is written persistent,
every other kernel as Inductor writes it.

The product reason (``engine_ext/compat/inductor.py``'s docstring): Inductor fuses a site
(:func:`dynsteer.engine_ext.worker.ops.steer_add`) into the next add + RMSNorm and writes that
kernel as a *looped* reduction (two walks over the row in blocks), with no persistent config to
autotune to, so it runs slower than stock's norms, which may run one pass over the row. With
``install`` the site's kernel is one pass over the row too (a ``triton_per_`` kernel).

The kernels are real Inductor output, generated without a GPU: with
``cpu_backend="triton"`` Inductor writes Triton kernels for CPU tensors, and only the Triton
compile that follows needs a backend (none here: the compile fails after the code is written,
and the test reads the kernels from its own Inductor cache folder). The graph is vLLM's native
fused add + RMSNorm twice, at hidden size 4096 with a dynamic token count as vLLM compiles it:
once with a stand-in :func:`steer_add` (a row gather and add, traced inside a function of that
name) on its input, once plain. On torch 2.13 (this venv), without ``install`` both kernels are
looped (``triton_red_``, ``for r0_offset in``).

The last test runs the kernels Inductor writes for the real site (``ops.steer_add`` and the
norm after it), looped and persistent, in Triton's CPU interpreter against float64.

Inductor's FX graph cache stays on (each compile in a folder of its own): torch 2.13 asks
``inductor_choices_class`` for a ``uuid()`` to key that cache, and vLLM pickles Inductor's
configuration, the class included, into its compile cache (where a class made inside a
function fails to pickle). The test leaves Inductor's choices, config and cache folder as it found
them.
"""

from __future__ import annotations

import ast
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inductor_codegen import kernel_sources
from triton_interpreter import require_interpreter

from dynsteer.engine_ext.compat import inductor

HIDDEN = 4096
TOKENS = 4
ROWS = 8


def steer_add(x: torch.Tensor, index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The fused site's form (``ops.steer_add``): each token's row of ``table``, added in fp32."""
    n = x.shape[0]
    return (x.float() + table[index[:n].long()]).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's native fused add + RMSNorm (fp32 math): the normalized row and the new residual."""
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    return normed.to(x.dtype), s.to(x.dtype)


def _forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor,
             residual2: torch.Tensor, weight2: torch.Tensor, index: torch.Tensor,
             table: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """A norm with the site on its input, and a plain one (no buffer shared between them)."""
    return (_add_rms_norm(steer_add(x, index, table), residual, weight),
            _add_rms_norm(x2, residual2, weight2))


def _inputs() -> list[torch.Tensor]:
    bf16 = torch.bfloat16
    inputs = [torch.randn(TOKENS, HIDDEN, dtype=bf16), torch.randn(TOKENS, HIDDEN, dtype=bf16),
              torch.randn(HIDDEN, dtype=bf16), torch.randn(TOKENS, HIDDEN, dtype=bf16),
              torch.randn(TOKENS, HIDDEN, dtype=bf16), torch.randn(HIDDEN, dtype=bf16),
              torch.zeros(64, dtype=torch.int32), torch.randn(ROWS, HIDDEN)]
    for tokens in (inputs[0], inputs[1], inputs[3], inputs[4]):
        torch._dynamo.mark_dynamic(tokens, 0)  # vLLM compiles for any number of tokens
    return inputs


def _reductions(cache: Path) -> dict[str, str]:
    """Every reduction kernel under an Inductor cache folder: its name and its source."""
    kernels: dict[str, str] = {}
    for path in sorted(cache.rglob("*.py")):
        for source in kernel_sources(path):
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith(
                        ("triton_red_", "triton_per_")):
                    kernels.setdefault(node.name, source)
    return kernels


def _generate(cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, dict[str, str]]:
    """Compile :func:`_forward` with Inductor's current choices into ``cache``: the site's
    kernel, the plain norm's kernel, and every reduction kernel's source by name."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    torch._dynamo.reset()
    with config.patch(cpu_backend="triton", compile_threads=1):
        try:
            torch.compile(_forward, fullgraph=True)(*_inputs())
        except Exception as e:  # the Triton compile, after the code is written
            if "compatible backends" not in str(e):
                raise
    kernels = _reductions(cache)
    site = [name for name in kernels if "_index_" in name]  # the row gather is in its name
    plain = [name for name in kernels if name not in site]
    assert len(site) == 1 and len(plain) == 1, sorted(kernels)
    return site[0], plain[0], kernels


@pytest.fixture
def codegen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inductor generating Triton code without a backend; its choices restored afterwards."""
    pytest.importorskip("triton")
    import torch._inductor.codegen.triton as triton_codegen
    import torch.utils._triton as torch_triton
    from torch._inductor import config
    from torch._inductor.virtualized import V

    # The generated code's header asks for the backend's hash, the only backend call before
    # the Triton compile.
    monkeypatch.setattr(torch_triton, "triton_hash_with_backend", lambda: "no-backend")
    if hasattr(triton_codegen, "triton_hash_with_backend"):  # torch 2.11 imports it by name
        monkeypatch.setattr(triton_codegen, "triton_hash_with_backend", lambda: "no-backend")
    configured, handler = config.inductor_choices_class, V.choices
    settings = inductor.PersistentSites.function, inductor.PersistentSites.max_row
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        config.inductor_choices_class = configured
        V.set_choices_handler(handler)
        inductor.PersistentSites.function, inductor.PersistentSites.max_row = settings


def _looped(source: str) -> bool:
    return "for r0_offset in" in source


def test_site_kernel_is_persistent_and_the_plain_norm_unchanged(
        codegen: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site, plain, stock = _generate(tmp_path / "stock", monkeypatch)
    assert site.startswith("triton_red_") and _looped(stock[site])
    assert plain.startswith("triton_red_") and _looped(stock[plain])

    inductor.install("steer_add", 16384)
    persistent_site, same_plain, installed = _generate(tmp_path / "installed", monkeypatch)
    assert persistent_site == site.replace("triton_red_", "triton_per_", 1)
    assert not _looped(installed[persistent_site])
    assert same_plain == plain
    assert installed[plain] == stock[plain]  # byte for byte: decorator, configs, loops


def test_a_row_longer_than_max_row_stays_looped(
        codegen: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    inductor.install("steer_add", HIDDEN // 2)
    assert config.inductor_choices_class is inductor.PersistentSites  # installed, yet:
    assert type(V.choices) is inductor.PersistentSites
    site, plain, kernels = _generate(tmp_path, monkeypatch)
    assert site.startswith("triton_red_") and _looped(kernels[site])
    assert plain.startswith("triton_red_") and _looped(kernels[plain])


def test_a_later_install_replaces_the_settings_and_the_class_pickles_by_name(
        codegen: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config

    inductor.install("steer_add", 16384)
    first = config.inductor_choices_class().uuid()
    inductor.install("steer_add", HIDDEN // 2)  # the later call's max_row wins
    assert config.inductor_choices_class().uuid() != first
    assert pickle.loads(pickle.dumps(config.inductor_choices_class)) is inductor.PersistentSites
    site, _, kernels = _generate(tmp_path, monkeypatch)
    assert site.startswith("triton_red_") and _looped(kernels[site])


def test_another_choices_class_is_left_alone(
        codegen: None, caplog: pytest.LogCaptureFixture) -> None:
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices

    class Theirs(InductorChoices):
        pass

    config.inductor_choices_class = Theirs
    with caplog.at_level(logging.WARNING):
        inductor.install("steer_add", 16384)
    assert config.inductor_choices_class is Theirs
    assert "keep Inductor's launch decision" in caplog.text


def test_remove_gives_inductor_its_own_choices_again(
        codegen: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with ``persistent_sites: false`` started after one with it on, in the same
    process: its site kernel is Inductor's looped one again."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    inductor.install("steer_add", 16384)
    inductor.remove()
    assert config.inductor_choices_class is None
    assert not isinstance(V.choices, inductor.PersistentSites)
    site, _, kernels = _generate(tmp_path, monkeypatch)
    assert site.startswith("triton_red_") and _looped(kernels[site])


INTERPRETED_SITE = """
import json, os, tempfile
import torch
import triton.language as tl
from torch._inductor import config
from torch._inductor.runtime import triton_helpers
from inductor_codegen import codegen_without_gpu
from test_inductor_choices import INTERPRETED_CASES
from test_steer_norm import EPS, GROUP_BIT, grouped, inputs
from dynsteer.engine_ext.compat import inductor
from dynsteer.engine_ext.worker import ops

codegen_without_gpu()  # no backend here: the header's hash only
# Two libdevice calls the interpreter lacks, as tl ops.
triton_helpers.libdevice.isnan = lambda v: v != v
triton_helpers.libdevice.rsqrt = lambda v: tl.rsqrt(v)


def site_then_norm(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram, weight):
    steered = ops.steer_add(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram,
                            GROUP_BIT)
    return ops.rms_norm_after(steered, h, weight, EPS)


out = []
caches = tempfile.TemporaryDirectory()
for case, (tokens, hidden, dtype, persistent) in enumerate(INTERPRETED_CASES):
    cache = os.path.join(caches.name, str(case))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch._dynamo.reset()
    if persistent:
        inductor.install("steer_add", hidden)
    else:
        inductor.remove()
    x, h, b, weight = inputs(tokens, hidden, getattr(torch, dtype), tokens + hidden, False)
    b = grouped(b)
    with config.patch(cpu_backend="triton", compile_threads=1):
        normed, stream = torch.compile(site_then_norm, fullgraph=True)(
            x, h, b.index, b.gate_score, b.table, b.dyn, b.proj_dir, b.proj_par, b.proj_gram,
            weight)
    sources = [open(os.path.join(d, f)).read() for d, _, fs in os.walk(cache) for f in fs
               if f.endswith(".py")]
    kinds = sorted({{kind for s in sources for kind in ("triton_per_", "triton_red_")
                    if "def " + kind in s and "isnan" in s}})
    out.append([normed.float().tolist(), stream.float().tolist(), kinds])
caches.cleanup()
print(json.dumps(out))
"""

INTERPRETED_CASES = ((5, 4096, "bfloat16", False), (5, 4096, "bfloat16", True),
                     (3, 4096, "float32", True))
"""``(tokens, hidden, dtype, persistent)``: the site kernel as Inductor writes it (looped at
4096) and as :func:`inductor.install` has it written (persistent), in bfloat16 as the GPU runs
it and in float32."""


def test_the_site_kernels_inductor_writes_match_float64_in_the_interpreter() -> None:
    """Inductor's own Triton code for a fused site and the add + RMSNorm after it
    (``ops.steer_add`` with site groups, then ``ops.rms_norm_after``), looped and persistent, run
    by Triton's CPU interpreter, against float64: the persistent kernel that ``install`` asks
    for computes what the looped one did (only the sum of squares is added in another order).
    Both tiers, gates earlier sites wrote, unsteered tokens and a token whose row steers
    another group of sites (:func:`test_steer_norm.grouped`)."""
    require_interpreter("tests/gpu runs the engine's kernels compiled")
    from test_steer_norm import check, grouped, inputs, norm_reference, ungrouped
    from triton_interpreter import run_interpreted

    got = run_interpreted(INTERPRETED_SITE)
    for (tokens, hidden, dtype, persistent), (normed, stream, kinds) in zip(
            INTERPRETED_CASES, got, strict=True):
        assert kinds == ["triton_per_" if persistent else "triton_red_"]
        x, h, b, weight = inputs(tokens, hidden, getattr(torch, dtype), tokens + hidden, False)
        want = norm_reference(x, h, ungrouped(grouped(b)), weight)
        check(torch.tensor(normed), torch.tensor(stream), b.gate_score, want, tokens, x.dtype,
              monitored=False)
