"""The Triton kernels Inductor makes of a fused site form, and the launch configs each one's
autotuner may choose between, found without a GPU.

Sessions 14 and 15 spent GPU time on two compile-time effects of a site form that the stack
microbenchmark does not show (``benchmarks/RESULTS.md``):

* **where Inductor puts the site**: the untied site-groups form went into the norm *before* the
  MLP and stored ``delta`` for the next norm to read back;
* **which configs a kernel gets**: the tied form's kernel was marked ``add_persistent_rblock``,
  so it was offered a persistent ``R0_BLOCK`` beside the looped one and Triton's autotuner picked
  between them once per compile, at the profile run's thousands of tokens.

Inductor decides both while generating code, before any GPU is involved. With
``cpu_backend="triton"`` it writes Triton kernels for CPU tensors; only the Triton compile that
follows needs a backend, and that is where this script stops. It compiles a stand-in of vLLM's
Llama decoder (vLLM's native fused add + RMSNorm; an extern matmul for attention and two around a
ReLU for the MLP, which Inductor cannot fuse across; the ``post_block`` site at every layer, with
``h`` the MLP's output) with each named form of :mod:`idle_variants`, and lists every reduction
kernel: whether it holds the site, its loads, the persistent mark, and the configs torch's own
heuristics give it (``return_configs=True``). One config means nothing is autotuned. A kernel
is marked ``site`` when it holds the site's own ops (reading the index, gathering rows); a
kernel without the mark is a plain add + RMSNorm or one that reads what a site stored.

The heuristics change between torch releases (torch 2.13 put every form's site after the MLP),
so run it with the GPU image's torch 2.11.0 and Triton 3.6.0 (``../shared/gpukit``), in a venv
of its own, e.g.::

    python3 -m venv /tmp/cg && /tmp/cg/bin/pip install torch==2.11.0 triton==3.6.0 pydantic
    /tmp/cg/bin/pip install --no-deps -e .
    /tmp/cg/bin/python experiments/site_codegen.py --out /tmp/cg-out current site-groups-tied

Each form compiles in a subprocess of its own (a fresh Inductor cache). Writes
``site_codegen.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SITE_OPS = re.compile(r"_(select|slice|index|constant_pad_nd)_")
"""In a kernel's name, the ops that tell a site is in it: every form reads the token's entry
of the index (``select``, ``slice``) and gathers rows (``index``, or ``F.pad`` where row 0 is
read as padding); a plain add + RMSNorm has none of them."""
_SHORT_NAME = re.compile(r"^triton_(red|per|poi)_fused_.*_(\d+)$")


def _codegen_without_gpu() -> None:
    """Let Inductor generate Triton code for CPU tensors where no Triton backend is present:
    the generated code's header asks for the backend's hash, the only backend call before the
    compile."""
    import torch._inductor.codegen.triton as triton_codegen
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton

    inductor_config.cpu_backend = "triton"
    torch_triton.triton_hash_with_backend = lambda: "no-backend"
    if hasattr(triton_codegen, "triton_hash_with_backend"):
        triton_codegen.triton_hash_with_backend = torch_triton.triton_hash_with_backend


def _decoder(site: Any, layers: int) -> Any:
    """The stand-in decoder: per layer, attention (a matmul), vLLM's native fused add +
    RMSNorm, the MLP (matmul, ReLU, matmul), the site on the residual with ``h`` the MLP's
    output; the next layer's fused add + RMSNorm follows it."""
    import torch

    from dynsteer.engine_ext.worker import ops

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        x = x.to(torch.float32) + residual.to(torch.float32)
        residual = x.to(torch.bfloat16)
        variance = x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(variance + 1e-5)).to(torch.bfloat16) * weight, residual

    def forward(hidden, residual, w_attn, w_norm_attn, w_norm_mlp, w_up, w_down, index,
                gate_score, table, dyn, proj_dir, proj_par, proj_gram):
        for layer in range(layers):
            hidden = hidden @ w_attn
            hidden, residual = add_rms_norm(hidden, residual, w_norm_attn)
            h = torch.relu(hidden @ w_up) @ w_down
            residual = site(residual, h, index, gate_score, table[layer], dyn[layer], proj_dir,
                            proj_par, proj_gram, ops.site_bit(layer, layers))
            hidden, residual = add_rms_norm(h, residual, w_norm_mlp)
        return hidden, residual

    return forward


def _inputs(tokens: int, hidden: int, layers: int, rows: int = 64) -> list[Any]:
    import torch

    from dynsteer.engine_ext.worker import ops

    bf16 = torch.bfloat16
    return [torch.randn(tokens, hidden, dtype=bf16), torch.randn(tokens, hidden, dtype=bf16),
            torch.randn(hidden, hidden, dtype=bf16), torch.randn(hidden, dtype=bf16),
            torch.randn(hidden, dtype=bf16),
            torch.randn(hidden, 1024, dtype=bf16), torch.randn(1024, hidden, dtype=bf16),
            torch.zeros(ops.INDEX_ROWS, tokens, dtype=torch.int32), torch.zeros(2, tokens),
            torch.zeros(layers, rows, hidden), torch.zeros(layers, rows, hidden),
            torch.zeros(rows, 0, hidden), torch.zeros(rows, 0, ops.PROJ_PARAMS),
            torch.zeros(rows, 0, 0)]


def _kernel_sources(path: Path) -> list[str]:
    """The Triton kernels a file of Inductor's cache holds: a kernel file, or the module that
    inlines its kernels as ``async_compile.triton(name, source)``."""
    text = path.read_text(errors="replace")
    found = []
    if "@triton.jit" in text and "async_compile.triton(" not in text:
        found.append(text)
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "triton" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.append(node.args[1].value)
    return found


def _configs(decorator: ast.Call, filename: str) -> list[dict[str, Any]]:
    """The launch configs torch's heuristics give a kernel: its ``@triton_heuristics.X(...)``
    decorator called again with ``return_configs=True``."""
    from torch._inductor.runtime import hints, triton_heuristics

    decorator.keywords.append(ast.keyword(arg="return_configs", value=ast.Constant(True)))
    names = {"triton_heuristics": triton_heuristics, "__file__": filename,
             **{n: getattr(hints, n) for n in ("AutotuneHint", "DeviceProperties",
                                               "ReductionHint", "TileHint")}}
    code = compile(ast.fix_missing_locations(ast.Expression(decorator)), filename, "eval")
    # Inductor's own code, from the cache folder this process has just written.
    return [{**c.kwargs, "num_warps": c.num_warps} for c in eval(code, names)]


def kernels(cache: Path) -> list[dict[str, Any]]:
    """Every reduction kernel under an Inductor cache folder, in order of its number."""
    listed: dict[str, dict[str, Any]] = {}
    for path in sorted(cache.rglob("*.py")):
        for source in _kernel_sources(path):
            for node in ast.parse(source).body:
                if not (isinstance(node, ast.FunctionDef) and node.decorator_list
                        and isinstance(node.decorator_list[0], ast.Call)):
                    continue
                decorator = node.decorator_list[0]
                meta = ast.get_source_segment(source, decorator) or ""
                if node.name in listed or "reduction" not in ast.unparse(decorator.func):
                    continue
                loads = re.search(r"'num_load': (\d+)", meta)
                listed[node.name] = {
                    "kernel": node.name, "site": bool(SITE_OPS.search(node.name)),
                    "num_load": int(loads.group(1)) if loads else None,
                    "persistent_mark": "'add_persistent_rblock': True" in meta,
                    "configs": _configs(decorator, str(path))}
    number = lambda k: int(_SHORT_NAME.match(k["kernel"]).group(2))  # noqa: E731
    return sorted(listed.values(), key=number)


def compile_form(variant: str, tokens: int, layers: int, hidden: int) -> list[dict[str, Any]]:
    """Generate the stand-in decoder's kernels with one site form (in this process: call it
    in a fresh one)."""
    cache = Path(tempfile.mkdtemp(prefix=f"site-codegen-{variant}-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from idle_variants import VARIANTS

    _codegen_without_gpu()
    inputs = _inputs(tokens, hidden, layers)
    torch._dynamo.mark_dynamic(inputs[0], 0)  # vLLM compiles for any number of tokens
    torch._dynamo.mark_dynamic(inputs[1], 0)
    try:
        torch.compile(_decoder(VARIANTS[variant], layers), fullgraph=True)(*inputs)
    except Exception as e:  # the Triton compile, after the code is written
        if "backend" not in str(e):
            raise
    return kernels(cache)


def _short(kernel: str) -> str:
    match = _SHORT_NAME.match(kernel)
    return f"{match.group(1)}_{match.group(2)}" if match else kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="site forms of experiments/idle_variants.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192,
                    help="the example's token count (the size hint the heuristics see; vLLM "
                         "compiles with its profile run's)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(compile_form(args.one, args.tokens, args.layers, args.hidden)))
        return
    import torch

    results: dict[str, Any] = {"torch": torch.__version__, "tokens": args.tokens,
                               "layers": args.layers, "hidden": args.hidden, "forms": {}}
    for variant in args.variants:
        done = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--one", variant, "--tokens",
             str(args.tokens), "--layers", str(args.layers), "--hidden", str(args.hidden),
             variant], capture_output=True, text=True, check=True)
        listed = json.loads(done.stdout.strip().splitlines()[-1])
        results["forms"][variant] = listed
        print(f"{variant} (torch {torch.__version__}, {args.tokens} tokens):")
        for k in listed:
            configs = ", ".join(f"R0_BLOCK {c.get('R0_BLOCK')} / {c['num_warps']} warps"
                                for c in k["configs"])
            mark = "yes" if k["persistent_mark"] else "no "
            tuned = "  (autotuned)" if len(k["configs"]) > 1 else ""
            print(f"  {_short(k['kernel']):>7} {'site' if k['site'] else '':>4} "
                  f"loads {k['num_load']}  persistent mark {mark}  configs: {configs}{tuned}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "site_codegen.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
