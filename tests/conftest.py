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

    Under pytest-xdist (``make test`` runs one worker per core) engines are not bound to a
    core: vLLM's CPU build binds every engine to core 0 by default, so two workers' engines
    would share one core and leave the other idle. A test that sets the binding itself
    (tensor parallelism: one core per rank) still does. Each worker, and every engine and
    server it starts, runs one OpenMP thread: unbound, each would start one per core, and two
    workers' parallel regions on two cores wait on each other's descheduled threads (a third
    slower in wall time than one thread each)."""
    if config.option.markexpr.replace(" ", "") == "notengine":
        os.environ["DYNSTEER_FAST_LANE"] = "1"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


SPLIT_BY_ARCHITECTURE = ("test_architectures.py", "test_steering_reference.py",
                         "test_gating_reference.py", "test_projection_reference.py")
"""Modules whose engines are a module-scoped fixture parametrized by architecture (the first
part of a test's parameter id): their architectures are spread over the workers."""


SLOWEST_FIRST = ("test_safety_steering.py", "test_inspect_refusal.py",
                 "test_controllers_experiment.py", "test_tensor_parallel.py", "test_load.py",
                 "test_safety_demo.py", "test_engine_behaviour.py", "test_server.py",
                 "test_capture.py", "test_probe_layers.py", "test_traffic_probe.py",
                 "test_data_parallel.py", "test_probe_registry.py", "test_request_capture.py")
"""The modules that take longest (one to three minutes each, ``--durations``), slowest first."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist the workers take modules in collection order: the slowest go first
    (:data:`SLOWEST_FIRST`), then the other modules that start engines, then those that start
    none, so that both workers end within a short module of each other instead of one
    finishing a seven-minute module alone. The order within a module is kept."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item: pytest.Item) -> int:
        name = Path(str(item.path)).name
        if name in SLOWEST_FIRST:
            return SLOWEST_FIRST.index(name)
        return len(SLOWEST_FIRST) + (0 if item.get_closest_marker("engine") else 1)

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n N --dist loadscope`` (``make test``): the tests of one module run in one
    worker, as they share its module-scoped engines, except in :data:`SPLIT_BY_ARCHITECTURE`,
    where each architecture's tests are a unit of their own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the order of pytest_collection_modifyitems

    class ByEngine(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, test = nodeid.partition("::")
            if module.rsplit("/", 1)[-1] in SPLIT_BY_ARCHITECTURE and "[" in test:
                return f"{module}[{test.split('[', 1)[1].split('-', 1)[0].rstrip(']')}]"
            return module

    return ByEngine(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir():
    """``tiny_model_dir(arch)`` -> path of a tiny random model (the same path in every run,
    so vLLM's compile cache is reused; see ``tiny_models.stable_model_dir``)."""

    def get(arch: str) -> Path:
        return stable_model_dir(f"tiny-{arch}", lambda path: make_tiny_model(arch, path), arch,
                                ARCHITECTURES[arch])

    return get


@pytest.fixture(scope="module")
def engines_without_inductor():
    """The module's engines run their compiled graph without Inductor
    (``engine_utils.WITHOUT_INDUCTOR``); request it with
    ``pytest.mark.usefixtures("engines_without_inductor")``."""
    from engine_utils import without_inductor

    with without_inductor():
        yield


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
    ``dynsteer.controllers`` entry points and a ``dynsteer.capture_sinks`` one, ``memory``
    (a ``.dist-info`` beside it on ``PYTHONPATH``, so
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
    (info / "entry_points.txt").write_text(
        "[dynsteer.controllers]\n" + "\n".join(lines) + "\n\n"
        "[dynsteer.capture_sinks]\nmemory = dynsteer_test_controllers:MemorySink\n")
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
