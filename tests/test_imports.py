"""controller/ and probes/ are usable without vLLM (and without torch); inside engine_ext/ only
the adapter module touches vLLM, so the next vLLM release is a change in one place."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "engine_ext" / "compat.py"


def test_controller_and_probes_import_without_vllm_or_torch():
    code = (
        "import sys; import dynsteer.controller, dynsteer.probes; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _vllm_imports(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_adapter_imports_vllm():
    found = {str(p.relative_to(ROOT)): lines
             for folder in ("engine_ext", "controller", "probes")
             for p in sorted((ROOT / folder).rglob("*.py"))
             if p != ADAPTER and (lines := _vllm_imports(p))}
    assert not found, f"vLLM imported outside engine_ext/compat.py: {found}"
