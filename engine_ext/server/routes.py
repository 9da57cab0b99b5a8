"""The ``/v1/dynsteer/`` routes: global steering, named vectors, info, telemetry, health, the
global capture.

Every body and response is a pydantic model of :mod:`dynsteer.controller.http_models`, so
``/openapi.json`` documents them. Bad input is HTTP 400 (404 for unknown names) with a message
naming the field; the engine keeps serving. Routes that change state or return another client's
data (request telemetry, capture) require the API key when one is configured (see
:func:`require_key`). Registering a name that exists is HTTP 409 unless ``?replace=true``; a full
registry is 409 too. Every change is checked and applied under one lock
(:meth:`.runtime.DynsteerServer.apply`), so concurrent requests cannot both take a free name or
the last free place.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from dynsteer.controller.http_models import (
    Deleted,
    GlobalCapture,
    GlobalSteering,
    Health,
    NameList,
    RequestReport,
    ServerInfo,
    VectorIn,
    VectorOut,
)
from dynsteer.controller.spec import SESSION_PATTERN, CaptureSpec, validation_message

from ..compat.frontend import Generation
from ..compat.server import vllm_version
from ..frontend import request_capture
from ..frontend.control_plane import ConflictError, UnknownNameError
from ..options import KERNEL_ABI, PLUGIN_VERSION
from .runtime import DynsteerServer
from .sessions import CALLER_PATTERN
from .settings import is_configured_key

PREFIX = "/v1/dynsteer"


def server_of(request: Request) -> DynsteerServer:
    """The dynsteer state of this app (503 when the engine was started without dynsteer)."""
    server = getattr(request.app.state, "dynsteer", None)
    if server is None:
        raise HTTPException(503, "dynsteer is not enabled on this engine: start it with "
                                 "`dynsteer serve` or --additional-config '{\"dynsteer\": {}}'")
    return server


def require_key(request: Request) -> None:
    """Guarded routes: ``Authorization: Bearer <key>`` must match a configured key, if any."""
    server = server_of(request)
    if not server.api_keys:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and is_configured_key(token, server.api_keys)):
        raise HTTPException(401, "Authorization: missing or wrong API key (send "
                                 "'Authorization: Bearer <key>')")


@contextmanager
def http_errors() -> Iterator[None]:
    """Validation failures become 400 (unknown names 404, taken names and full registries 409)
    carrying the field-naming message."""
    try:
        yield
    except UnknownNameError as e:
        raise HTTPException(404, str(e)) from e
    except ConflictError as e:
        raise HTTPException(409, str(e)) from e
    except ValueError as e:
        raise HTTPException(400, str(e)) from e


class DynsteerRoute(APIRoute):
    """Bodies that fail their pydantic model answer HTTP 400 worded like every other dynsteer
    error (``steer[0].vector[0]: 1e+39 is not finite in float32``), whatever the server's own
    handler for validation errors does with other routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                message = validation_message(list(e.errors()))
                return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                               "param": message.partition(":")[0],
                                               "code": 400}}, status_code=400)

        return handle


router = APIRouter(prefix=PREFIX, tags=["dynsteer"], route_class=DynsteerRoute)
Server = Depends(server_of)
Guarded = [Depends(require_key)]
"""Routes that change state or reveal other clients' data."""


@router.get("/health", response_model=Health)
async def health(server: DynsteerServer = Server) -> Health:
    """Whether every worker's steering state answers."""
    try:
        results = await server.rpc("dynsteer_info", timeout=10.0)
    except Exception as e:
        raise HTTPException(503, f"workers do not answer: {e}") from e
    return Health(status="ok", workers=len(results))


@router.get("/info", response_model=ServerInfo)
async def info(server: DynsteerServer = Server) -> ServerInfo:
    """The served model's shape, the configured sites and the versions."""
    f = server.frontend
    return ServerInfo(
        model=server.model_name, hidden_size=f.hidden_size, num_layers=f.num_layers,
        sites=f.site_names(), max_rows=f.options.max_rows, plugin_version=PLUGIN_VERSION,
        kernel_abi=KERNEL_ABI, vllm_version=vllm_version(),
    )


@router.get("/capture/global", response_model=GlobalCapture, dependencies=Guarded)
async def get_global_capture(server: DynsteerServer = Server) -> GlobalCapture:
    """The capture every completion that asks for none gets (None: off), and which
    completions it covers."""
    return _global_capture(server)


@router.put("/capture/global", response_model=GlobalCapture, dependencies=Guarded)
async def put_global_capture(
        body: CaptureSpec, server: DynsteerServer = Server,
        session: str | None = Query(None, pattern=SESSION_PATTERN,
                                    description="only requests of this (namespaced) session"),
        caller: str | None = Query(None, pattern=CALLER_PATTERN,
                                   description="only requests of the API key of this "
                                   "namespace (-/: requests without a configured key)"),
) -> GlobalCapture:
    """Capture every completion that asks for no capture of its own into a sink
    (dataset collection while serving; with ``when: "gated"``, the requests with a gate whose
    gate fired: the audit log of a probe-gated deployment), or only those of one session or
    one API key; applies to requests received from now on."""
    with http_errors():
        check_global_capture(body, server.frontend)
    server.frontend.global_capture = body.model_dump(exclude_none=True)
    server.frontend.global_capture_scope = {"session": session, "caller": caller}
    return _global_capture(server)


@router.delete("/capture/global", response_model=GlobalCapture, dependencies=Guarded)
async def delete_global_capture(server: DynsteerServer = Server) -> GlobalCapture:
    """Stop the global capture."""
    server.frontend.global_capture = None
    server.frontend.global_capture_scope = {}
    return GlobalCapture()


def _global_capture(server: DynsteerServer) -> GlobalCapture:
    return GlobalCapture.model_validate({"capture": server.frontend.global_capture,
                                         **server.frontend.global_capture_scope})


def check_global_capture(capture: CaptureSpec, frontend: Any) -> None:
    """A global capture names a configured sink (its rows have no response to go to), its
    sites are monitor sites and the capture lanes hold them (ValueError naming the field)."""
    if capture.sink is None:
        raise ValueError("sink: a global capture needs a sink (the server's "
                         "--dynsteer-capture-sinks); its rows have no response to go to")
    request_capture.admit(capture, frontend.shape(), frontend.options, 1, Generation(1),
                          frontend.sinks, prefix="capture")


@router.get("/global", response_model=GlobalSteering)
async def get_global(server: DynsteerServer = Server) -> GlobalSteering:
    """The global steering every request gets."""
    return GlobalSteering.model_validate({"steer": server.frontend.global_entries})


@router.put("/global", response_model=GlobalSteering, dependencies=Guarded)
async def put_global(body: GlobalSteering, server: DynsteerServer = Server) -> GlobalSteering:
    """Replace global steering (applies to requests admitted from now on and live ones)."""
    with http_errors():
        await server.apply(lambda: server.plane.set_global(body.steer))
    return GlobalSteering.model_validate({"steer": server.frontend.global_entries})


@router.delete("/global", response_model=GlobalSteering, dependencies=Guarded)
async def delete_global(server: DynsteerServer = Server) -> GlobalSteering:
    """Remove global steering."""
    await server.apply(server.plane.clear_global)
    return GlobalSteering()


@router.post("/vectors", response_model=VectorOut, status_code=201, dependencies=Guarded)
async def post_vector(body: VectorIn, replace: bool = False,
                      server: DynsteerServer = Server) -> VectorOut:
    """Register a named vector, usable as ``"vector": name`` in specs (409 when the name is
    taken, unless ``?replace=true``). Persisted in the store when one is configured."""
    with http_errors():
        await server.register_vector(body.name, body.values(), replace=replace)
    return VectorOut(name=body.name, vector=server.frontend.vectors[body.name].tolist())


@router.get("/vectors", response_model=NameList)
async def list_vectors(server: DynsteerServer = Server) -> NameList:
    return NameList(names=sorted(server.frontend.vectors))


@router.get("/vectors/{name}", response_model=VectorOut)
async def get_vector(name: str, server: DynsteerServer = Server) -> VectorOut:
    values = server.frontend.vectors.get(name)
    if values is None:
        raise HTTPException(404, f"name: unknown vector {name!r}")
    return VectorOut(name=name, vector=values.tolist())


@router.delete("/vectors/{name}", response_model=Deleted, dependencies=Guarded)
async def delete_vector(name: str, server: DynsteerServer = Server) -> Deleted:
    """Forget a named vector; requests already admitted keep their steering."""
    with http_errors():
        await server.unregister_vector(name)
    return Deleted(deleted=name)


@router.get("/requests/{request_id}", response_model=RequestReport, dependencies=Guarded)
async def request_report(request_id: str, server: DynsteerServer = Server) -> RequestReport:
    """How a recent steered request was steered, with its gate telemetry if it had a gate.

    ``request_id`` is the ``id`` of the OpenAI response (``chatcmpl-...`` / ``cmpl-...``; for
    a completion of several prompts, its first one, or ``cmpl-...-i`` for prompt ``i``).
    The most recent steered requests are kept (bounded, see ``RECENT_REQUESTS``).
    """
    found = server.frontend.find_recent(request_id)
    if found is None:
        raise HTTPException(404, f"request_id: {request_id!r} is not a recent steered request")
    engine_id, record = found
    telemetry = None
    if record.gated:
        telemetry = (await server.rpc("dynsteer_telemetry", engine_id))[0]
    return RequestReport.model_validate({"request_id": request_id, "static": record.static,
                                         "gated": record.gated, "telemetry": telemetry})
