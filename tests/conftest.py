"""Shared fixtures: tiny models on disk (one per architecture per session), the HF reference
model of the tiny Llama, and the tiny chat model a `dynsteer serve` test serves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# tests/ is on the path: pyproject.toml's ``pythonpath`` (with benchmarks/ and experiments/).
from tiny_models import ARCHITECTURES, make_tiny_model, stable_model_dir


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-m "not engine"`` (the fast lane) a test that starts an engine fails, naming
    the mark it lacks (``engine_utils.refuse_in_fast_lane``).

    Under pytest-xdist (``make test`` runs one worker per core) each worker's engines run on
    a core of their own: vLLM's CPU build binds every engine to core 0 by default, so two
    workers' engines would share one core and leave the other idle. A test that sets the
    binding itself (tensor parallelism: one core per rank) still does."""
    if config.option.markexpr.replace(" ", "") == "notengine":
        os.environ["DYNSTEER_FAST_LANE"] = "1"
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        core = int(worker[2:]) % (os.cpu_count() or 1)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``pytest -n N --dist loadgroup``: the tests of one module run in one worker
    (they share its module-scoped engines), split further by the parameter of a module-scoped
    parametrized fixture (``test_architectures``: one group per architecture, so its engines
    spread over the workers). Runs before xdist reads the groups."""
    for item in items:
        group = item.nodeid.split("::", 1)[0]
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            defs = item._fixtureinfo.name2fixturedefs
            shared = [name for name in callspec.params
                      if name in defs and defs[name][-1].scope == "module"]
            if shared:
                group += "[" + "-".join(str(callspec.params[name]) for name in shared) + "]"
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny_model_dir():
    """``tiny_model_dir(arch)`` -> path of a tiny random model (the same path in every run,
    so vLLM's compile cache is reused; see ``tiny_models.stable_model_dir``)."""

    def get(arch: str) -> Path:
        return stable_model_dir(f"tiny-{arch}", lambda path: make_tiny_model(arch, path), arch,
                                ARCHITECTURES[arch])

    return get


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir):
    """The tiny Llama in HF transformers (the reference of ``hf_reference``)."""
    from hf_reference import load_hf  # on use: unit-test runs need neither helper module

    return load_hf(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def chat_model() -> Path:
    """A tiny Llama with the embedded model's tokenizer and chat template (see
    ``server_utils.make_chat_model``), at a stable path like ``tiny_model_dir``."""
    from server_utils import make_chat_model

    return stable_model_dir("tiny-chat", make_chat_model, "chat")


CONTROLLER_PLUGINS = {"pylatch": "PyLatch", "half": "Half", "switcher": "Switcher",
                      "raiser": "Raiser"}


@pytest.fixture(scope="session")
def controller_plugins(tmp_path_factory):
    """Installs ``tests/plugins/dynsteer_test_controllers.py`` as a distribution with
    ``dynsteer.controllers`` entry points (a ``.dist-info`` beside it on ``PYTHONPATH``, so
    engine processes started afterwards find them too)."""
    import importlib
    import os
    import shutil

    root = tmp_path_factory.mktemp("controller-plugins")
    shutil.copy(Path(__file__).parent / "plugins" / "dynsteer_test_controllers.py", root)
    info = root / "dynsteer_test_controllers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dynsteer-test-controllers\n"
                                   "Version: 0.1\n")
    lines = [f"{n} = dynsteer_test_controllers:{c}" for n, c in CONTROLLER_PLUGINS.items()]
    (info / "entry_points.txt").write_text("[dynsteer.controllers]\n" + "\n".join(lines) + "\n")
    sys.path.insert(0, str(root))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), old) if p)
    importlib.invalidate_caches()
    yield root
    sys.path.remove(str(root))
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old
