"""``experiments/site_codegen.py`` reads Inductor's generated Triton code right: which kernels
hold a site, their loads and persistent mark, and the launch configs torch's heuristics give
each (two where the persistent config is offered beside the looped one, which the autotuner
then picks between; one where it is not). The code generation itself needs torch's Triton
backend and runs outside CI (the script's docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from site_codegen import kernels

DEVICE = ("DeviceProperties(type='cpu', index=None, multi_processor_count=2, cc='', major=None, "
          "regs_per_multiprocessor=None, max_threads_per_multi_processor=None, "
          "max_threads_per_block=1024, warp_size=None)")


def _kernel(name: str, loads: int, persistent: bool) -> str:
    """A reduction kernel as Inductor writes it (decorator and signature; the body is not read)."""
    mark = ", 'add_persistent_rblock': True" if persistent else ""
    return f"""
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties

@triton_heuristics.reduction(
    size_hints={{'x': 8192, 'r0_': 4096}},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={{'signature': {{'in_ptr0': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32'}},
                 'device': {DEVICE}, 'constants': {{}}}},
    inductor_meta={{'kernel_name': '{name}', 'num_load': {loads}, 'num_store': 1,
                   'num_reduction': 1{mark}}}
)
@triton.jit
def {name}(in_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    r0_numel = 4096
"""


def test_kernels_lists_sites_loads_and_the_configs_each_may_be_tuned_between(tmp_path):
    norm = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
    site = "triton_red_fused__to_copy_abs_add_constant_pad_nd_index_le_select_slice_where_2"
    tied = "triton_red_fused__to_copy_add_isnan_select_slice_where_4"
    heavy = "triton_red_fused__to_copy_add_index_select_slice_5"
    module = tmp_path / "ab" / "cabmodule.py"
    module.parent.mkdir()
    module.write_text(
        "from torch._inductor.async_compile import AsyncCompile\n"
        "async_compile = AsyncCompile()\n"
        f"{site} = async_compile.triton({site!r}, '''{_kernel(site, 7, False)}''', "
        "device_str='cpu')\n"
        f"{norm} = async_compile.triton({norm!r}, '''{_kernel(norm, 5, True)}''', "
        "device_str='cpu')\n")
    (tmp_path / "cd").mkdir()
    (tmp_path / "cd" / "ccdkernel.py").write_text(_kernel(tied, 7, True))
    (tmp_path / "cd" / "ccdheavy.py").write_text(_kernel(heavy, 9, True))
    listed = kernels(tmp_path)
    assert [k["kernel"] for k in listed] == [norm, site, tied, heavy]
    by_name = {k["kernel"]: k for k in listed}
    assert [by_name[n]["site"] for n in (norm, site, tied, heavy)] == [False, True, True, True]
    assert by_name[site]["num_load"] == 7 and not by_name[site]["persistent_mark"]
    assert by_name[norm]["persistent_mark"]
    persistent, looped = by_name[norm]["configs"]
    assert (persistent["R0_BLOCK"], looped["R0_BLOCK"]) == (4096, 2048)
    assert by_name[tied]["configs"] == by_name[norm]["configs"]
    assert [c["R0_BLOCK"] for c in by_name[site]["configs"]] == [2048]
    # Ten loads and reductions: no persistent config, and a smaller block for the registers.
    assert [c["R0_BLOCK"] for c in by_name[heavy]["configs"]] == [1024]
