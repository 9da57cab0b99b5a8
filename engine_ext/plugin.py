"""The ``vllm.general_plugins`` entry point: connects dynsteer to the adapter's hooks.

vLLM calls :func:`register` in the frontend, the engine core and every worker, possibly several
times. It only installs patches that check, per engine, whether the plugin is enabled
(``additional_config={"dynsteer": {...}}`` or ``DYNSTEER_ENABLE=1``); an engine that did not
ask for dynsteer runs exactly as stock vLLM apart from a dictionary lookup at load time and one
per request. The callbacks below import dynsteer's modules on first use, so a process where
no engine enables the plugin loads only this module and the adapter's patching code.

With ``DYNSTEER_EXIT_WITH_PARENT=1`` (set by ``dynsteer serve``) it also makes the engine core and
worker processes exit when the process that started them dies (:mod:`.parent_watch`); without
it, nothing is started.
"""

from __future__ import annotations

import os
from typing import Any

from dynsteer.controller.extra_args import GUARD_KEY, SPEC_KEY

from . import parent_watch

CONFIG_KEY = "dynsteer"
"""Key of the plugin's options in vLLM's ``additional_config``."""
ENABLE_ENV = "DYNSTEER_ENABLE"
"""Set to 1 to enable the plugin with default options when ``additional_config`` has no key."""
KILL_SWITCH_ENV = "DYNSTEER_DISABLE"
"""Set to 1 to make register() install no patches even where the plugin is configured (the
parent watch of ``DYNSTEER_EXIT_WITH_PARENT`` still runs)."""

_registered = False


def requested(additional_config: Any) -> bool:
    """Whether an engine asks for dynsteer (its options are validated later)."""
    if isinstance(additional_config, dict) and CONFIG_KEY in additional_config:
        return True
    return os.environ.get(ENABLE_ENV, "") in ("1", "true", "True")


def register() -> None:
    """Install dynsteer's patches in this process (idempotent, cheap)."""
    global _registered
    if os.environ.get(parent_watch.ENV):
        parent_watch.install()
    if _registered or os.environ.get(KILL_SWITCH_ENV, "") in ("1", "true", "True"):
        return
    from .compat import compile_cache, frontend, scheduler, worker

    compile_cache.install(_compile_key_config)
    frontend.install(frontend.FrontendHooks(
        configure=_configure, engine_state=_engine_state, admit=_admit, admitted=_admitted,
        spec_key=SPEC_KEY))
    scheduler.install(scheduler.SchedulerHooks(guard_of=_guard_of, stats=_engine_core_stats,
                                               claims_of=_claims_of, budget_for=_budget_for))
    worker.install(_on_model_loaded)
    _registered = True


def _compile_key_config(additional_config: Any) -> Any:
    if not requested(additional_config):
        return additional_config
    from .options import compile_key_config

    return compile_key_config(additional_config)


# ---- frontend ----------------------------------------------------------------------------
def _configure(additional_config: dict[str, Any]) -> dict[str, Any] | None:
    if not requested(additional_config):
        return None
    from .frontend import admission

    return admission.configure(additional_config)


def _engine_state(facts: Any) -> Any:
    if not requested(facts.additional_config):
        return None
    from .frontend import admission

    return admission.engine_state(facts)


def _admit(state: Any, extra_args: dict[str, Any] | None) -> Any:
    if state is None and not (extra_args and SPEC_KEY in extra_args):
        return None
    from .frontend import admission

    return admission.admit(state, extra_args)


def _admitted(state: Any, request_id: str, spec: Any, prompt_len: int, generation: Any,
              extra_args: dict[str, Any] | None) -> dict[str, Any] | None:
    from .frontend import admission

    return admission.admitted(state, request_id, spec, prompt_len, generation, extra_args)


# ---- engine core -------------------------------------------------------------------------
def _guard_of(extra_args: dict[str, Any] | None) -> Any:
    if not extra_args or GUARD_KEY not in extra_args:
        return None
    from .prefix_guard import scheduler

    return scheduler.guard_of(extra_args)


def _engine_core_stats() -> dict[str, int]:
    from . import row_budget
    from .prefix_guard import scheduler

    return {**scheduler.stats(), **row_budget.stats()}


def _claims_of(extra_args: dict[str, Any] | None) -> Any:
    if not extra_args:
        return None
    from . import row_budget

    return row_budget.claims_of(extra_args)


def _budget_for(additional_config: dict[str, Any]) -> Any:
    if not requested(additional_config):
        return None
    from . import row_budget
    from .options import options_from_additional_config

    options = options_from_additional_config(additional_config)
    if options is None:
        return None
    return row_budget.RowBudget(options.max_rows, options.max_gates or options.max_rows)


# ---- workers -----------------------------------------------------------------------------
def _on_model_loaded(runner: Any, additional_config: dict[str, Any]) -> None:
    if not requested(additional_config):
        return
    from .worker import attach

    attach.on_model_loaded(runner, additional_config)
