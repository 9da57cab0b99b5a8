"""The worker data plane's module graph: no import cycle among its modules (module-level and
function-level imports alike), the layout a plain module, and every module importable on its
own, as the first dynsteer module of its process."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "engine_ext" / "worker"
PACKAGE = "dynsteer.engine_ext.worker"
HAS_TRITON = importlib.util.find_spec("triton") is not None
"""The kernels package needs Triton (CUDA, or its CPU interpreter); without it, only the
import graph covers it."""


def _modules() -> dict[str, Path]:
    """Dotted name (under the worker package) -> file, packages by their ``__init__``."""
    out = {}
    for path in sorted(WORKER.rglob("*.py")):
        parts = list(path.relative_to(WORKER).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _worker_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The worker modules ``name`` imports, wherever in the file (a function-level import closes
    a cycle as surely as a top-level one)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                if node.level - 1 > len(package):
                    continue  # above the worker package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.startswith(PACKAGE + "."):
                target = node.module[len(PACKAGE) + 1:].split(".")
            else:
                continue
            dotted = ".".join(target)
            for alias in node.names:  # ``from . import ops`` names a module
                sub = f"{dotted}.{alias.name}" if dotted else alias.name
                if sub in modules:
                    found.add(sub)
                elif dotted in modules:
                    found.add(dotted)
    found.discard(name)
    return found


def test_no_import_cycle_among_worker_modules():
    modules = _modules()
    graph = {name: _worker_imports(name, path, modules) for name, path in modules.items()}
    assert graph["ops"] and graph["kernels.steer"], "the parser finds imports"
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt):], nxt] if nxt in trail else [name, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_layout_is_a_plain_module():
    """Every kernel and op imports the layout; it imports nothing of theirs (nor torch)."""
    tree = ast.parse((WORKER / "layout.py").read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    assert imported <= {"__future__", "collections.abc", "typing"}, imported


def test_wire_resolution_is_pure_numpy():
    """Resolving a request's spec needs no device: numpy and the vLLM-free controller package
    only (its unit tests, ``test_resolve.py``, run without an engine)."""
    tree = ast.parse((WORKER / "resolve.py").read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    allowed = {"__future__", "collections.abc", "dataclasses", "typing", "numpy"}
    assert all(m in allowed or m.startswith("dynsteer.controller.") for m in imported), imported


PRELOAD = ("numpy", "torch", "triton", "vllm", "pydantic", "msgspec", "zmq", "safetensors")
"""Third-party packages the check imports once, before the first module: what stays loaded
between modules. None of them imports dynsteer (the check asserts it)."""

_IMPORT_EACH_ALONE = """
import importlib, importlib.util, json, os, sys, traceback

for lib in PRELOAD:
    if importlib.util.find_spec(lib) is not None:
        importlib.import_module(lib)
preloaded = sorted(m for m in sys.modules if m.split(".")[0] == "dynsteer")
results = {"preloaded_dynsteer": preloaded, "failed": {}, "loaded": {}}
for name in NAMES:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that has loaded no dynsteer module: this one is the first
        os.close(read)
        for loaded in [m for m in sys.modules if m.split(".")[0] == "dynsteer"]:
            del sys.modules[loaded]
        seen = []
        class Order:
            def find_spec(self, fullname, path=None, target=None):
                if fullname.split(".")[0] == "dynsteer":
                    seen.append(fullname)
        sys.meta_path.insert(0, Order())
        try:
            importlib.import_module(name)
            out = {"loaded": seen}
        except BaseException:
            out = {"error": traceback.format_exc(limit=4)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "the child died"}')
    if "error" in out:
        results["failed"][name] = out["error"]
    else:
        results["loaded"][name] = out["loaded"]
print(json.dumps(results))
"""


def test_each_worker_module_imports_alone():
    """Every worker module imports as the first dynsteer module of its process (past its own
    packages): a module that only imports because another one loaded something first fails
    here. One child process per module, forked from one that has imported the heavy
    third-party packages (torch, vLLM, Triton) and no dynsteer module, so each child starts
    with none and the check stays fast."""
    names = [f"{PACKAGE}.{n}" if n else PACKAGE for n in _modules()
             if HAS_TRITON or not (n == "kernels" or n.startswith("kernels."))]
    code = f"PRELOAD = {PRELOAD!r}\nNAMES = {names!r}\n" + _IMPORT_EACH_ALONE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["preloaded_dynsteer"] == [], "a preloaded package imported dynsteer"
    assert results["failed"] == {}, "\n".join(f"{n}:\n{e}" for n, e in results["failed"].items())
    # Each child found and ran its module (and its dependencies) anew: the check is not vacuous.
    assert all(name in results["loaded"][name] for name in names)
    assert f"{PACKAGE}.layout" in results["loaded"][f"{PACKAGE}.ops"]
