"""Make vLLM's CPU build reuse its own AOT compile cache (vLLM 0.32).

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

from typing import Any

from .patching import when_imported

_MODULE = "torch._dynamo.aot_compile_types"


def install() -> None:
    when_imported(_MODULE, _add_finalize_loading)


def _add_finalize_loading(module: Any) -> None:
    bundled = getattr(module, "BundledAOTAutogradSerializableCallable", None)
    if bundled is not None and not hasattr(bundled, "finalize_loading"):
        bundled.finalize_loading = _nothing_to_finalize


def _nothing_to_finalize(self: Any, vllm_config: Any) -> None:
    """The Inductor artifact is complete as loaded."""
