"""vLLM's compile cache: reused by the CPU build, keyed only by what reaches the graph.

**The cache key.** vLLM names its compile cache by a hash of the engine configuration, which
includes all of ``additional_config``, so a new controller socket address or registry cap would
recompile the model (a minute on a GPU). The hash is computed with ``additional_config`` as a
callback reduces it (dynsteer drops its options that never reach the compiled graph).

**Reuse on the CPU build** (vLLM 0.32).

On the CPU platform vLLM compiles with plain Inductor (``DYNAMO_TRACE_ONCE``); the artifact it
saves loads back as torch's ``BundledAOTAutogradSerializableCallable``, and vLLM's loader
(``vllm/compilation/decorators.py``, ``_try_load_aot_compiled_fn``) then calls
``finalize_loading(vllm_config)``, which only vLLM's own GPU artifact type has. The
AttributeError is logged ("Compiling model again due to a load failure") and every engine start
recompiles, 10-40 s per start on a 2-core machine. The artifact needs no finalizing, so the
method is added as a no-op where it is missing; nothing else changes (the cache key, and so the
check that the configuration and the traced source are the same, stays vLLM's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .patching import when_imported

_MODULE = "torch._dynamo.aot_compile_types"
_CONFIG_MODULE = "vllm.config.vllm"


def install(hashed_config: Callable[[Any], Any]) -> None:
    """``hashed_config(additional_config)``: what of it the compile-cache key is to see (the
    same object when nothing is to be left out)."""
    when_imported(_MODULE, _add_finalize_loading)
    when_imported(_CONFIG_MODULE, functools.partial(_hash_reduced_config, hashed_config))


def _hash_reduced_config(hashed_config: Callable[[Any], Any], module: Any) -> None:
    config_class = module.VllmConfig
    original = config_class.compute_hash
    if getattr(original, "_dynsteer", False):
        return

    @functools.wraps(original)
    def compute_hash(self: Any) -> str:
        full = self.additional_config
        reduced = hashed_config(full)
        if reduced is full:
            return original(self)
        # The hash reads the attribute; put the reduced dict there for the call only.
        object.__setattr__(self, "additional_config", reduced)
        try:
            return original(self)
        finally:
            object.__setattr__(self, "additional_config", full)

    compute_hash._dynsteer = True  # type: ignore[attr-defined]
    config_class.compute_hash = compute_hash


def _add_finalize_loading(module: Any) -> None:
    bundled = getattr(module, "BundledAOTAutogradSerializableCallable", None)
    if bundled is not None and not hasattr(bundled, "finalize_loading"):
        bundled.finalize_loading = _nothing_to_finalize


def _nothing_to_finalize(self: Any, vllm_config: Any) -> None:
    """The Inductor artifact is complete as loaded."""
