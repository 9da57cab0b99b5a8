"""The ``vllm.endpoint_plugins`` entry point: mounts dynsteer on vLLM's own API server.

vLLM (0.26 and later) calls :meth:`DynsteerEndpoints.attach_router` while building the app and
:meth:`DynsteerEndpoints.init_state` once the engine client exists. Endpoint plugins load only
when named in ``VLLM_PLUGINS`` (``dynsteer serve`` sets it).
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..compat.frontend import engine_state
from ..server import probe_routes, routes
from .commands import CommandServer
from .metrics import install_collector
from .middleware import DynsteerMiddleware
from .runtime import DynsteerServer, WorkerError
from .sessions import client
from .settings import ServerSettings, api_keys

logger = logging.getLogger("vllm.dynsteer.server")


def _model_name(args: Namespace) -> str:
    served = getattr(args, "served_model_name", None)
    if served:
        return served[0] if isinstance(served, (list, tuple)) else str(served)
    return str(getattr(args, "model", ""))


async def _worker_error(request: Request, exc: Exception) -> JSONResponse:
    """A failed worker call: 503 with our message only (the details went to the log)."""
    return JSONResponse({"error": {"message": str(exc), "type": "ServiceUnavailable",
                                   "code": 503}}, status_code=503)


class DynsteerEndpoints:
    """Routes under ``/v1/dynsteer/``, the extra_body spec, body limits and metrics."""

    name = "dynsteer"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.settings = ServerSettings.from_env()

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(routes.router)
        app.include_router(probe_routes.router)
        app.add_exception_handler(WorkerError, _worker_error)
        app.add_middleware(DynsteerMiddleware, max_body_bytes=self.settings.max_body_bytes,
                           max_request_bytes=self.settings.max_request_bytes)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:  # the CPU-only render server has no engine
            return
        if (getattr(args, "api_server_count", 1) or 1) > 1:
            raise RuntimeError(
                "dynsteer: --api-server-count > 1 is not supported (each API server process "
                "would keep its own registry and prefix-cache fingerprints); use 1")
        frontend = engine_state(engine_client)
        if frontend is None:
            logger.warning("dynsteer: routes mounted but the engine was started without "
                           "dynsteer; they answer 503")
            return
        keys = api_keys(self.settings, getattr(args, "api_key", None))
        frontend.default_caller = client(None, keys)  # a request that lost its caller
        server = DynsteerServer(engine_client, frontend, self.settings, keys, _model_name(args))
        await probe_routes.restore_registry(server)
        if frontend.options.commands_address is not None:
            server.commands = CommandServer(server, frontend.options.commands_address)
            server.commands.start()
        state.dynsteer = server
        install_collector(server)
        logger.info("dynsteer: routes ready under /v1/dynsteer (%d sites, mutating routes %s)",
                    len(frontend.sites), "need an API key" if keys else "are open")
