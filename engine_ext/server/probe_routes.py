"""``/v1/dynsteer/probes`` (upload, list, read, delete named probes) and
``/v1/dynsteer/capture`` (activations to train them on).

An upload is checked completely (body size, name, finite weights of the served hidden size,
metadata of at most 64 KiB as stored, a configured monitor site, the training fingerprint, a
free name or ``?replace=true``, room in the registry) before anything changes; then it is
registered on every worker and written to the store (when configured, atomically), all under
the lock that orders changes, so a restarted server serves the same probes and vectors (see
:func:`restore_registry`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request

from dynsteer.controller.http_models import (
    CaptureResponse,
    Deleted,
    ProbeList,
    ProbeSummary,
    ProbeUpload,
)

from ..frontend.capture import CaptureArgs, capture_async, encode_result
from ..frontend.control_plane import Change, ConflictError, ControlError
from .disconnect import unless_disconnected
from .routes import (
    PREFIX,
    DynsteerRoute,
    Guarded,
    Server,
    http_errors,
)
from .runtime import DynsteerServer

logger = logging.getLogger("vllm.dynsteer.server")

router = APIRouter(prefix=PREFIX, tags=["dynsteer probes"], route_class=DynsteerRoute)


@router.post("/probes", response_model=ProbeSummary, status_code=201, dependencies=Guarded)
async def post_probe(body: ProbeUpload, replace: bool = False,
                     server: DynsteerServer = Server) -> ProbeSummary:
    """Register a probe, usable as ``"probe": name`` in a request's gate (409 when the name is
    taken, unless ``?replace=true``)."""
    with http_errors():
        probe = body.to_probe()
        await server.register_probe(probe, replace=replace)
    return ProbeSummary.of(probe)


@router.get("/probes", response_model=ProbeList)
async def list_probes(server: DynsteerServer = Server) -> ProbeList:
    """Every registered probe. Open to anyone, so metadata larger than
    :data:`~dynsteer.controller.http_models.LISTED_METADATA_BYTES` is left out here
    (``metadata_omitted``); ``GET /probes/{name}`` returns it whole."""
    probes = server.frontend.probes  # None: bare weights (offline API only), nothing to show
    return ProbeList(probes=[ProbeSummary.of(probe) for _, probe in sorted(probes.items())
                             if probe is not None])


@router.get("/probes/{name}")
async def get_probe(name: str, server: DynsteerServer = Server) -> dict:
    """The probe as :meth:`dynsteer.probes.Probe.to_json_dict` (weights base64 float32)."""
    probe = server.frontend.probes.get(name)
    if probe is None:
        raise HTTPException(404, f"name: unknown probe {name!r}")
    return probe.to_json_dict()


@router.delete("/probes/{name}", response_model=Deleted, dependencies=Guarded)
async def delete_probe(name: str, server: DynsteerServer = Server) -> Deleted:
    """Forget a probe (and its stored file); requests already admitted keep their gate."""
    with http_errors():
        await server.unregister_probe(name)
    return Deleted(deleted=name)


async def restore_registry(server: DynsteerServer) -> None:
    """Register every stored vector and probe at startup, oldest first (see
    :mod:`.registry_store`). One that no longer fits this model is skipped, loudly; those a cap
    (``max_vectors``, ``max_probes``) leaves no room for are moved out of the store, loudly, so
    that the store keeps holding what the registry holds."""
    store = server.store
    if store is None:
        return
    plane = server.plane
    await _restore(server, "vector", "max_vectors", store.set_aside_vector,
                   [(name, partial(plane.register_vector, name, values))
                    for name, values in store.load_vectors()])
    await _restore(server, "probe", "max_probes", store.set_aside_probe,
                   [(probe.name, partial(plane.register_probe_object, probe))
                    for probe in store.load_probes()])
    logger.info("dynsteer: %d vectors and %d probes restored from %s",
                len(server.frontend.vectors), len(server.frontend.probes), store.folder)


async def _restore(server: DynsteerServer, kind: str, option: str,
                   set_aside: Callable[[str], Path],
                   stored: list[tuple[str, Callable[[], Change]]]) -> None:
    """Apply each stored entry's change (no store write: it is stored); names in a store are
    unique, so a conflict means the registry is full."""
    over_limit: list[str] = []
    for name, build in stored:
        try:
            await server.apply(build)
        except ConflictError:
            over_limit.append(name)
        except ControlError as e:
            logger.error("dynsteer: stored %s %r does not fit this model: %s", kind, name, e)
    if over_limit:
        moved_to = {str(set_aside(name)) for name in over_limit}
        logger.error(
            "dynsteer: %d stored %ss not restored: the registry is full at %d, the limit (engine "
            "option dynsteer.%s), and they are the newest: %s; moved to %s (raise the limit and "
            "move them back to restore them)", len(over_limit), kind,
            getattr(server.frontend.options, option), option, ", ".join(map(repr, over_limit)),
            ", ".join(sorted(moved_to)))


@router.post("/capture", response_model=CaptureResponse, dependencies=Guarded)
async def capture(body: CaptureArgs, request: Request, server: DynsteerServer = Server) -> dict:
    """Residual-stream activations of prompts at sites, computed by the served engine (for
    training probes). Captures run concurrently with each other and with other traffic, as
    ordinary requests. A client that disconnects cancels its capture (its requests are
    aborted and their rows freed)."""
    with http_errors():
        result = await unless_disconnected(
            request, capture_async(server.engine, body.prompts, body.sites, body.reduce))
    return encode_result(result)
