"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in the frontend, the engine core and every worker, possibly several
times. It only installs patches that check, per engine, whether the plugin is enabled
(``additional_config={"dynsteer": {...}}`` or ``DYNSTEER_ENABLE=1``); an engine that did not
ask for dynsteer runs exactly as stock vLLM apart from a dictionary lookup at load time and one
per request.

With ``DYNSTEER_EXIT_WITH_PARENT=1`` (set by ``dynsteer serve``) it also makes the engine core and
worker processes exit when the process that started them dies (:mod:`.parent_watch`); without
it, nothing is started.
"""

from __future__ import annotations

import os

from dynsteer.engine_ext import parent_watch

KILL_SWITCH_ENV = "DYNSTEER_DISABLE"
"""Set to 1 to make register() install no patches even where the plugin is configured (the
parent watch of ``DYNSTEER_EXIT_WITH_PARENT`` still runs)."""

_registered = False


def register() -> None:
    """Install dynsteer's patches in this process (idempotent, cheap)."""
    global _registered
    if os.environ.get(parent_watch.ENV):
        parent_watch.install()
    if _registered or os.environ.get(KILL_SWITCH_ENV, "") in ("1", "true", "True"):
        return
    from dynsteer.engine_ext import ops  # noqa: F401  (defines torch.ops.dynsteer.*)
    from dynsteer.engine_ext.compat import patch_frontend, patch_scheduler, patch_workers

    patch_frontend()
    patch_scheduler()
    patch_workers()
    _registered = True
