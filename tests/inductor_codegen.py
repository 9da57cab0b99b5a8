"""Reading the Triton code Inductor generates, without a GPU (``test_inductor_choices.py``).

With ``cpu_backend="triton"`` Inductor writes Triton kernels for CPU tensors; only the Triton
compile that follows needs a backend. :func:`codegen_without_gpu` lets the code generation run
where no backend is present, and :func:`kernel_sources` reads the kernels back from Inductor's
cache folder."""

from __future__ import annotations

import ast
from pathlib import Path


def codegen_without_gpu() -> None:
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


def kernel_sources(path: Path) -> list[str]:
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
