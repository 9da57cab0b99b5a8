"""Attaches a :class:`SteeringState` to a model runner once its model is loaded (workers)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..compat import inductor
from ..compat import model as vllm_model
from ..compat import worker as vllm_worker
from ..options import EngineOptions, options_from_additional_config
from .capture_sink import open_sinks
from .events import EngineEvents, EventPublisher
from .layout import PERSISTENT_SITE_ROW
from .ops import steer_add
from .sites import install_sites
from .state import SteeringState

# Under "vllm." so vLLM's logging configuration (format, level) applies to our records.
logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])


class _SlotMap:
    """Stable small integers for requests of the V1 runner, whose batch rows move around.

    Slot 0 is reserved for requests the state never saw, so it always maps to row 0.
    """

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 1

    def take(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            slot = self._free.pop() if self._free else self._next
            self._next += slot == self._next
            self._slots[req_id] = slot
        return slot

    def drop(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def lookup(self, req_ids: list[str]) -> np.ndarray:
        get = self._slots.get
        return np.fromiter((get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))


def on_model_loaded(runner: Any, additional_config: dict[str, Any]) -> None:
    """Attach where the engine enabled dynsteer (once per runner)."""
    options = options_from_additional_config(additional_config)
    if options is not None and vllm_worker.runner_state(runner) is None:
        attach(runner, options)


def attach(runner: Any, options: EngineOptions) -> SteeringState:
    """Wrap the model's sites, allocate the buffers and hook the runner's steps."""
    facts = vllm_worker.runner_facts(runner)
    sites = options.engine_sites(facts.num_layers)
    state = SteeringState(
        sites=sites.all,
        monitor_sites=sites.monitor,
        hidden_size=facts.hidden_size,
        max_rows=options.max_rows,
        max_gates=options.max_gates,
        max_projections=options.max_projections,
        site_groups=options.site_groups,
        max_tokens=facts.max_tokens,
        max_slots=facts.max_requests + 1,
        device=facts.device,
        capture_lanes=options.capture_lanes,
        capture_tokens=options.capture_tokens,
        block_size=facts.block_size,
    )
    writer = vllm_worker.sink_writer() if options.capture_sinks else None
    if writer is not None:
        state.capture.sinks = open_sinks(options.capture_sinks, *writer)
    if options.events_address is not None and vllm_worker.is_output_rank():
        state.set_events(EngineEvents(EventPublisher(options.events_address,
                                                     options.events_queue),
                                      options.events_every))
    buffers = vllm_worker.batch_buffers(runner)
    if buffers is not None:
        state.enable_device_fill(buffers.query_start_loc, buffers.positions)
    fuse_norms = options.fused_norms and not facts.norm_passes
    if options.fused_norms and facts.norm_passes and facts.device.type == "cuda":
        logger.info("dynsteer: sites stay out of the RMSNorm kernels (fused_norms), since "
                    "vLLM fuses those norms itself here: %s", ", ".join(facts.norm_passes))
    if facts.device.type == "cuda":  # the kernels fused sites are in (compat/inductor)
        if options.persistent_sites:
            inductor.install(steer_add.__name__, PERSISTENT_SITE_ROW)
        else:
            inductor.remove()
    installed = install_sites(facts.model, state.site_buffers(), fuse_norms)
    vllm_model.relay_between_stages(facts.model, state.gate_score,
                                    vllm_worker.stage_buffers(runner))
    state.capture.installed = frozenset(installed)
    vllm_worker.set_runner_state(runner, state)

    slot_map = _SlotMap()

    def on_add(req_id: str, slot: int | None, extra_args: Any, prompt_len: int) -> None:
        state.add_request(req_id, slot_map.take(req_id) if slot is None else slot, extra_args,
                          prompt_len)

    def on_remove(req_id: str, finished: bool) -> None:
        state.remove_request(req_id, finished)
        slot_map.drop(req_id)

    def on_step(req_ids: list[str], slots: np.ndarray | None, num_computed: np.ndarray,
                num_scheduled: np.ndarray, device_slots: torch.Tensor | None) -> None:
        if not state.needs_fill:
            state.skip_step()
            return
        state.fill(slot_map.lookup(req_ids) if slots is None else slots, num_computed,
                   num_scheduled, device_slots)

    timer = state.host_time
    vllm_worker.install_step_hooks(
        runner, timer.timed("admit", on_add), timer.timed("finish", on_remove),
        timer.timed("step", on_step), timer.timed("output", state.after_forward),
        state.skip_step, timer.timed("finish", state.after_updates))
    logger.info(
        "dynsteer: %d steering sites (%d monitor sites) on %s (max_rows=%d, capture %d lanes "
        "x %d tokens)", len(installed), len(sites.monitor & set(installed)),
        type(facts.model).__name__, options.max_rows, options.capture_lanes,
        options.capture_tokens,
    )
    return state
