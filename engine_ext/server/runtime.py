"""The per-server state behind the dynsteer routes: engine client, frontend, control plane.

Mutations run one at a time (an asyncio lock), each as check, worker RPC, frontend update, store
write: the order every TP rank applies changes in is the order the frontend records them in,
and a check (a taken name, a full registry) sees the registry its change is committed to, so
concurrent clients cannot both pass it (see :meth:`DynsteerServer.apply`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from dynsteer.probes import Probe

from ..compat import frontend as vllm_frontend
from ..compat.scheduler import STATS_UTILITY
from ..frontend.admission import FrontendState
from ..frontend.control_plane import Change, ControlPlane
from . import sinks
from .registry_store import RegistryStore
from .settings import ServerSettings
from .stream_rows import StreamRows

logger = logging.getLogger("vllm.dynsteer.server")

STATS_TIMEOUT_S = 5.0
"""How long a /metrics scrape waits for the workers' counters before using the last ones."""


class WorkerError(RuntimeError):
    """A worker RPC failed (HTTP 503 with this message; the details are in the log)."""


class StoreError(WorkerError):
    """A change was applied but the store could not record it (HTTP 503 like a failed worker
    call, with this message; the details are in the log)."""


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
        self.sinks: dict[str, Any] = sinks.build(settings.capture_sinks)
        """Capture sinks by name (:mod:`.sinks`)."""
        frontend.sinks = frozenset(self.sinks)
        self.stream_rows = StreamRows(self.rpc)
        """Reads streamed completions' rows as they are computed."""
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

    async def apply(self, change: Change | Callable[[], Change],
                    persist: Callable[[RegistryStore], None] | None = None) -> None:
        """Check a change, apply it on every worker, then in the frontend, then in the store,
        all under the lock that orders changes.

        ``change``: best a builder, a zero-argument callable that runs the control plane's
        checks and returns the :class:`Change`: run under the lock, checks that read the
        registry (a taken name, a full registry, a named vector's norm) see the registry the
        change is committed to. A ready :class:`Change` is applied as checked. ``persist``
        records the committed change in the store (when one is configured); it runs only for
        a change that passed its checks and reached every worker, so the store holds exactly
        what the registry holds.
        """
        build = change if callable(change) else lambda: change
        async with self._lock:
            checked = build()
            await self.rpc(checked.method, *checked.rpc_args())
            checked.commit()
            if persist is not None and self.store is not None:
                _record(persist, self.store)

    async def register_vector(self, name: str, values: Any, replace: bool = False) -> None:
        """Register a named vector on every worker (persisted when a store is configured)."""
        await self.apply(lambda: self.plane.register_vector(name, values, replace=replace),
                         lambda store: store.save_vector(name, self.frontend.vectors[name]))

    async def unregister_vector(self, name: str) -> None:
        """Forget a named vector (and its stored file)."""
        await self.apply(lambda: self.plane.unregister_vector(name),
                         lambda store: store.delete_vector(name))

    async def register_probe(self, probe: Probe, replace: bool = False) -> None:
        """Register a probe under its name (persisted when a store is configured)."""
        await self.apply(lambda: self.plane.register_probe_object(probe, replace=replace),
                         lambda store: store.save_probe(probe))

    async def unregister_probe(self, name: str) -> None:
        """Forget a named probe (and its stored file)."""
        await self.apply(lambda: self.plane.unregister_probe(name),
                         lambda store: store.delete_probe(name))

    async def update_probe(self, name: str, threshold: float,
                           sharpness: float | None = None) -> None:
        """A registered probe's new threshold (and sharpness), persisted with the probe."""
        await self.apply(lambda: self.plane.update_probe(name, threshold, sharpness),
                         lambda store: self._save_probe(store, name))

    def _save_probe(self, store: RegistryStore, name: str) -> None:
        probe = self.frontend.probes[name]
        if probe is not None:  # bare weights (offline API only) have no file form
            store.save_probe(probe)

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


def _record(persist: Callable[[RegistryStore], None], store: RegistryStore) -> None:
    """Run ``persist`` on the store; a failing disk is a :class:`StoreError` for the client."""
    try:
        persist(store)
    except OSError as e:
        logger.exception("dynsteer: the probe store %s could not record a change", store.folder)
        raise StoreError("dynsteer: the change was applied but the probe store could not record "
                         f"it ({e.strerror or e}); it is lost at restart unless made again; see "
                         "the server log") from e
