"""Import boundaries: controller/ and probes/ are usable without vLLM (and without torch);
inside engine_ext/ only the adapter package touches vLLM, so the next vLLM release is a change
in one place; the adapter never imports dynsteer back; loading the plugin, and the top-level
package (api/) every import of dynsteer loads first, is cheap."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "engine_ext" / "compat"

VLLM_ATTRIBUTES = frozenset({
    "vllm_config", "model_config", "cache_config", "scheduler_config", "compilation_config",
    "model_runner", "input_processor", "llm_engine", "engine_core", "collective_rpc",
    "call_utility", "call_utility_async", "kv_cache_manager", "req_states", "input_batch",
    "get_model", "is_driver_worker", "sampling_params", "prompt_token_ids",
    "scheduled_new_reqs", "finished_req_ids",
})
"""Attributes of vLLM objects (engines, runners, requests, configs) only the adapter reads."""


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, relative level) of every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
    return found


def test_controller_and_probes_import_without_vllm_or_torch():
    code = (
        "import sys; import dynsteer.controller.spec, dynsteer.probes; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_the_top_level_package_is_cheap():
    """Every ``dynsteer.*`` import (the plugin's in every vLLM process) imports ``dynsteer``
    first: it loads no submodule and none of vLLM, torch, numpy, pydantic or scikit-learn, also
    when listed; its names load on first use."""
    code = (
        "import json, sys; before = set(sys.modules); import dynsteer; dir(dynsteer); "
        "print(json.dumps(sorted(m for m in set(sys.modules) - before "
        "if m.split('.')[0] in ('dynsteer', 'vllm', 'torch', 'numpy', 'pydantic', 'sklearn'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["dynsteer"]


def test_the_top_level_package_is_not_a_dynsteer_folder():
    """The top-level package lives in ``api/`` (pyproject.toml's package-dir maps it): a
    ``dynsteer/`` folder in the repository root would shadow the installed package wherever the
    root is on ``sys.path`` (``python -m pytest`` there, as on the GPU host, where the project is
    installed non-editable) and hide ``dynsteer.engine_ext`` and the other subpackages."""
    assert not (ROOT / "dynsteer").exists()
    assert (ROOT / "api" / "__init__.py").is_file()


def test_only_the_adapter_touches_vllm():
    imports, attributes = {}, {}
    for path in _sources("api", "engine_ext", "controller", "probes"):
        if ADAPTER in path.parents:
            continue
        name = str(path.relative_to(ROOT))
        lines = [n for n, module, level in _imports(path)
                 if level == 0 and (module == "vllm" or module.startswith("vllm."))]
        if lines:
            imports[name] = lines
        used = sorted({node.attr for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Attribute) and node.attr in VLLM_ATTRIBUTES})
        if used:
            attributes[name] = used
    assert not imports, f"vLLM imported outside engine_ext/compat/: {imports}"
    assert not attributes, f"vLLM attributes read outside engine_ext/compat/: {attributes}"


def test_the_adapter_does_not_import_dynsteer():
    """The adapter calls dynsteer only through the callbacks its ``install`` functions take."""
    found = {str(p.relative_to(ROOT)): lines for p in _sources("engine_ext/compat")
             if (lines := [n for n, module, level in _imports(p)
                           if module.startswith("dynsteer") or level > 1])}
    assert not found, found


def test_imports_inside_a_package_are_relative():
    """A reader of the checkout can follow ``from .worker.state import ...``; there is no
    ``dynsteer/`` folder on disk to follow ``dynsteer.engine_ext...`` into."""
    found = {}
    for top in ("engine_ext", "controller", "probes"):
        for path in _sources(top):
            lines = [n for n, module, level in _imports(path)
                     if level == 0 and module.startswith(f"dynsteer.{top}")]
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, found


def test_loading_the_plugin_where_it_is_not_enabled_is_cheap():
    """vLLM loads the plugin in every process; without an engine that enables it, only the
    entry point and the adapter's patching code load (no spec models, no worker code)."""
    code = (
        "import json, sys; before = set(sys.modules); "
        "import dynsteer.engine_ext.plugin as p; p.register(); "
        "print(json.dumps(sorted(m for m in set(sys.modules) - before "
        "if m.startswith('dynsteer'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={**__import__("os").environ, "VLLM_PLUGINS": ""})
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    allowed = {"dynsteer", "dynsteer.engine_ext", "dynsteer.engine_ext.plugin",
               "dynsteer.engine_ext.parent_watch", "dynsteer.engine_ext.prefix_guard",
               "dynsteer.controller", "dynsteer.controller.contract",
               "dynsteer.controller.extra_args"}
    assert {m for m in loaded if not m.startswith("dynsteer.engine_ext.compat")} <= allowed, loaded


def test_extra_args_keys_are_defined_in_one_module() -> None:
    """Every key a request's ``extra_args`` carries is spelled once, in
    ``controller/extra_args.py``: no other product module writes one of them as a literal (so a
    key renamed there cannot leave a stale copy that the frontend writes and a worker never
    reads)."""
    from dynsteer.controller import extra_args

    keys = set(extra_args.FRONTEND_KEYS)  # SPEC_KEY, "dynsteer", names many other things
    assert all(k.startswith(extra_args.RESERVED_PREFIX) for k in extra_args.FRONTEND_KEYS)
    home = ROOT / "controller" / "extra_args.py"
    spelled = []
    for path in _sources("engine_ext", "controller", "probes", "api"):
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in keys:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, "extra_args keys spelled outside controller/extra_args.py:\n" + \
        "\n".join(spelled)
