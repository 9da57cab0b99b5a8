"""The per-server state behind the dynsteer routes: engine client, frontend, control plane.

Mutations run one at a time (an asyncio lock): the worker RPC first, then the frontend update,
so the order every TP rank applies changes in is the order the frontend records them in.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..compat import frontend as vllm_frontend
from ..compat.scheduler import STATS_UTILITY
from ..frontend.admission import FrontendState
from ..frontend.control_plane import Change, ControlPlane
from .registry_store import RegistryStore
from .settings import ServerSettings

logger = logging.getLogger("vllm.dynsteer.server")

STATS_TIMEOUT_S = 5.0
"""How long a /metrics scrape waits for the workers' counters before using the last ones."""


class WorkerError(RuntimeError):
    """A worker RPC failed (HTTP 503 with this message; the details are in the log)."""


class DynsteerServer:
    """Everything the routes need, stored on ``app.state.dynsteer``."""

    def __init__(self, engine_client: Any, frontend: FrontendState, settings: ServerSettings,
                 api_keys: list[str], model_name: str) -> None:
        self.engine = engine_client
        self.frontend = frontend
        self.plane = ControlPlane(frontend)
        self.settings = settings
        self.api_keys = api_keys
        self.model_name = model_name
        self.store = RegistryStore(settings.probe_store) if settings.probe_store else None
        """Where registered probes and vectors persist (None: memory only)."""
        self.worker_stats: dict[str, Any] = {}
        """Counters of TP rank 0 as of the last refresh (every rank sees the same tokens)."""
        self.guard_stats: dict[str, int] = {}
        """Prefix-guard counters of the engine core as of the last refresh."""
        self.commands: Any = None
        """The controller command socket (:class:`.commands.CommandServer`; None: off)."""
        self._lock = asyncio.Lock()

    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call a ``dynsteer_*`` worker method on every worker; one result per worker.

        A failure is logged with its details and raised as :class:`WorkerError`, whose message
        is safe to show a client (no RPC or traceback wording).
        """
        try:
            return await vllm_frontend.rpc_async(self.engine, method, args, timeout)
        except Exception as e:
            logger.exception("dynsteer: worker call %s failed", method)
            raise WorkerError(f"dynsteer: the engine's workers could not run {method}; "
                              "see the server log") from e

    async def apply(self, change: Change) -> None:
        """Apply a validated change on every worker, then in the frontend."""
        async with self._lock:
            await self.rpc(change.method, *change.rpc_args())
            change.commit()

    async def register_vector(self, name: str, values: Any, replace: bool = False) -> None:
        """Register a named vector on every worker (persisted when a store is configured)."""
        change = self.plane.register_vector(name, values, replace=replace)
        if self.store is not None:
            self.store.save_vector(name, values)
        await self.apply(change)

    async def update_probe(self, name: str, threshold: float,
                           sharpness: float | None = None) -> None:
        """A registered probe's new threshold (and sharpness), persisted with the probe."""
        await self.apply(self.plane.update_probe(name, threshold, sharpness))
        probe = self.frontend.probes.get(name)
        if self.store is not None and probe is not None:
            self.store.save_probe(probe)

    async def refresh_stats(self) -> None:
        """Fetch the workers' and the engine core's counters (for /metrics); keeps the last
        ones on failure."""
        try:
            results, guard = await asyncio.wait_for(asyncio.gather(
                self.rpc("dynsteer_info"),
                vllm_frontend.engine_core_call_async(self.engine, STATS_UTILITY)),
                STATS_TIMEOUT_S)
        except Exception as e:  # a scrape must never fail because of us
            logger.warning("dynsteer: counters unavailable: %s", e)
            return
        if results:
            self.worker_stats = results[0]
        self.guard_stats = guard
