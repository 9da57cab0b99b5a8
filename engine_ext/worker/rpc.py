"""RPC methods vLLM mixes into every worker (``worker_extension_cls``).

Reached through ``collective_rpc`` so every TP rank applies the same change in the same order.
Names carry a ``dynsteer_`` prefix so they cannot clash with the worker's own attributes.
Arguments are plain msgpack-able values, never pickled objects: the control plane's changes
arrive checked, in the resolved form of :mod:`dynsteer.controller.wire` (float32 bytes, numbers,
names; see :mod:`dynsteer.engine_ext.frontend.control_plane`), and are applied as they are.
"""

from __future__ import annotations

from typing import Any

from dynsteer.controller.wire import RawEntry, WireProbe

from ..compat import worker as vllm_worker
from .state import SteeringState


class DynsteerWorkerExtension:
    """Control plane of the steering state on one worker."""

    def _dynsteer(self) -> SteeringState:
        state = vllm_worker.worker_state(self)
        if state is None:
            raise RuntimeError("dynsteer is not active on this worker (model not loaded?)")
        return state

    # Registry changes carry the registry generation they create (numbered by the frontend,
    # which writes it into every request it admits from then on).
    def dynsteer_register_vector(self, name: str, data: bytes, generation: int) -> None:
        """``data``: the vector's little-endian float32 bytes."""
        self._dynsteer().registry.register_vector(name, data, generation)

    def dynsteer_unregister_vector(self, name: str, generation: int) -> None:
        self._dynsteer().registry.unregister_vector(name, generation)

    def dynsteer_set_global(self, entries: list[RawEntry], key: str) -> None:
        """``key``: the fingerprint requests admitted under these entries carry."""
        self._dynsteer().set_global(entries, key)

    def dynsteer_register_probe(self, name: str, probe: WireProbe, generation: int) -> None:
        """``probe``: ``[weights float32 bytes, threshold, sharpness]``."""
        self._dynsteer().registry.register_probe(name, probe, generation)

    def dynsteer_update_probe(self, name: str, threshold: float, sharpness: float | None,
                              generation: int) -> None:
        """New threshold (and sharpness) of a registered probe, for requests admitted later."""
        self._dynsteer().registry.update_probe(name, threshold, sharpness, generation)

    def dynsteer_unregister_probe(self, name: str, generation: int) -> None:
        self._dynsteer().registry.unregister_probe(name, generation)

    def dynsteer_telemetry(self, request_id: str) -> dict[str, Any] | None:
        return self._dynsteer().telemetry.report(request_id)

    def dynsteer_info(self) -> dict[str, Any]:
        return self._dynsteer().info()

    # ---- activation capture (collected by dynsteer.engine_ext.frontend.request_capture) --
    def dynsteer_collect_activations(self, requests: list[tuple[str, int | None, int]],
                                     inbox: dict[str, str] | None = None, keep: bool = False
                                     ) -> dict[str, Any] | None:
        """Requests' own captured rows (then freed, unless ``keep``), each ``(id, computed,
        since)``; None on all but TP rank 0 (of each pipeline stage). ``inbox``: the
        frontend's folder for large replies (:mod:`.capture_transfer`)."""
        return self._dynsteer().collect_activations(
            [(str(r), None if c is None else int(c), int(since)) for r, c, since in requests],
            reply=self._dynsteer_replies(), inbox=inbox, keep=bool(keep))

    def dynsteer_flush_capture_sinks(self) -> dict[str, dict[str, int]]:
        """Seal the engine's capture sinks' shards whose requests finished (after writing
        everything queued); this worker's counters per sink (empty where it writes none)."""
        return self._dynsteer().flush_capture_sinks()

    def _dynsteer_replies(self) -> bool:
        """Whether this worker answers for its pipeline stage (TP rank 0)."""
        return vllm_worker.replies(self)
