"""``/v1/dynsteer/probes`` (upload, list, read, delete named probes) and
``/v1/dynsteer/capture`` (activations to train them on).

An upload is checked completely (body size, name, finite weights of the served hidden size, a
configured monitor site, the training fingerprint, a free name or ``?replace=true``, room in the
registry) before anything changes; then it is written to the store (when configured,
atomically) and registered on every worker, so a restarted server serves the same probes and
vectors (see :func:`restore_registry`).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException

from dynsteer.controller.contract import site_name
from dynsteer.controller.http_models import (
    CaptureResponse,
    Deleted,
    ProbeList,
    ProbeSummary,
    ProbeUpload,
)
from dynsteer.probes import Probe

from ..frontend.capture import CaptureArgs, capture_async, encode_result
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


def _summary(probe: Probe) -> ProbeSummary:
    return ProbeSummary(name=probe.name, site=site_name((probe.site.hook, probe.site.layer)),
                        threshold=probe.threshold, sharpness=probe.sharpness,
                        metadata=dict(probe.metadata))


@router.post("/probes", response_model=ProbeSummary, status_code=201, dependencies=Guarded)
async def post_probe(body: ProbeUpload, replace: bool = False,
                     server: DynsteerServer = Server) -> ProbeSummary:
    """Register a probe, usable as ``"probe": name`` in a request's gate (409 when the name is
    taken, unless ``?replace=true``)."""
    with http_errors():
        probe = body.to_probe()
        change = server.plane.register_probe_object(probe, replace=replace)
    if server.store is not None:
        server.store.save_probe(probe)
    await server.apply(change)
    return _summary(probe)


@router.get("/probes", response_model=ProbeList)
async def list_probes(server: DynsteerServer = Server) -> ProbeList:
    probes = server.frontend.probes  # None: bare weights (offline API only), nothing to show
    return ProbeList(probes=[_summary(probe) for _, probe in sorted(probes.items())
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
        change = server.plane.unregister_probe(name)
    await server.apply(change)
    if server.store is not None:
        server.store.delete_probe(name)
    return Deleted(deleted=name)


async def restore_registry(server: DynsteerServer) -> None:
    """Register every stored vector and probe at startup; one that no longer fits this model
    (or these engine options) is skipped, loudly."""
    if server.store is None:
        return
    for name, values in server.store.load_vectors():
        try:
            change = server.plane.register_vector(name, values)
        except ValueError as e:
            logger.error("dynsteer: stored vector %r does not fit this model: %s", name, e)
            continue
        await server.apply(change)
    for probe in server.store.load_probes():
        try:
            change = server.plane.register_probe_object(probe)
        except ValueError as e:
            logger.error("dynsteer: stored probe %r does not fit this model: %s", probe.name, e)
            continue
        await server.apply(change)
    logger.info("dynsteer: %d vectors and %d probes restored from %s",
                len(server.frontend.vectors), len(server.frontend.probes), server.store.folder)


@router.post("/capture", response_model=CaptureResponse, dependencies=Guarded)
async def capture(body: CaptureArgs, server: DynsteerServer = Server) -> dict:
    """Residual-stream activations of prompts at sites, computed by the served engine (for
    training probes). Runs one capture at a time; other traffic continues alongside."""
    with http_errors():
        result = await capture_async(server.engine, body.prompts, body.sites, body.reduce)
    return encode_result(result)
