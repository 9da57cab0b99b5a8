"""The dynsteer routes on a FastAPI app with a fake engine client (no vLLM engine): error
wording and statuses that do not need a model, and internal errors kept out of bodies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from dynsteer.controller.contract import encode_f32
from dynsteer.engine_ext.frontend.admission import FrontendState
from dynsteer.engine_ext.options import EngineOptions
from dynsteer.engine_ext.server.endpoint import DynsteerEndpoints
from dynsteer.engine_ext.server.runtime import DynsteerServer
from dynsteer.engine_ext.server.settings import ServerSettings

HIDDEN = 8
KEY = "k"
INTERNAL = "RPC call to dynsteer_register_vector failed: Traceback (most recent call last)"


class FakeEngine:
    """Answers every worker RPC, or fails like vLLM's RPC layer does (internal wording)."""

    def __init__(self) -> None:
        self.fail = False
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, timeout: Any = None,
                             args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        if self.fail:
            raise RuntimeError(INTERNAL)
        return [None]


def message(response: Any) -> str:
    """The error message: vLLM's ``{"error": {...}}`` shape, or FastAPI's ``detail`` (routes'
    HTTPExceptions, which vLLM's own handler rewraps in a real server)."""
    body = response.json()
    return body["error"]["message"] if "error" in body else body["detail"]


@pytest.fixture()
def app(tmp_path):
    engine = FakeEngine()
    frontend = FrontendState(options=EngineOptions(max_vectors=2), hidden_size=HIDDEN,
                             num_layers=2, sites=(("post_block", 0), ("post_block", 1)))
    settings = ServerSettings(probe_store=tmp_path / "store")
    endpoints = DynsteerEndpoints()
    api = FastAPI()
    endpoints.attach_router(api)
    api.state.dynsteer = DynsteerServer(engine, frontend, settings, [KEY], "tiny")
    with TestClient(api, raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        yield client, engine


def test_a_failing_worker_call_is_503_without_internal_wording(app):
    client, engine = app
    engine.fail = True
    response = client.post("/v1/dynsteer/vectors", json={"name": "v", "vector": [0.1] * HIDDEN})
    assert response.status_code == 503
    text = response.text
    assert "dynsteer_register_vector" in text and "see the server log" in text
    assert "Traceback" not in text and "RPC call" not in text
    engine.fail = False
    assert client.get("/v1/dynsteer/vectors").json()["names"] == []  # nothing half-registered


def test_body_validation_is_400_worded_like_specs(app):
    client, _ = app
    response = client.put("/v1/dynsteer/global",
                          json={"steer": [{"vector": [1e39] * HIDDEN, "layers": [0]}]})
    assert response.status_code == 400
    assert message(response) == (
        "steer[0].vector[0]: 1e+39 is not finite in float32 (|x| at most 3.40282e+38)")
    response = client.post("/v1/dynsteer/vectors",
                           json={"name": "v", "vector_b64": encode_f32([np.nan] * HIDDEN)})
    assert response.status_code == 400
    assert message(response).startswith("vector[0]: nan is not finite")


def test_names_duplicates_caps_and_keys(app):
    client, _ = app
    body = {"name": "a", "vector": [0.1] * HIDDEN}
    assert client.post("/v1/dynsteer/vectors", json=body).status_code == 201
    assert client.post("/v1/dynsteer/vectors", json=body).status_code == 409
    assert client.post("/v1/dynsteer/vectors?replace=true", json=body).status_code == 201
    assert client.post("/v1/dynsteer/vectors", json={**body, "name": "b"}).status_code == 201
    full = client.post("/v1/dynsteer/vectors", json={**body, "name": "c"})
    assert full.status_code == 409 and "max_vectors" in full.text
    for name in (".hidden", "..", "."):
        assert client.post("/v1/dynsteer/vectors", json={**body, "name": name}).status_code == 400
    anonymous = client.get("/v1/dynsteer/requests/chatcmpl-x", headers={"Authorization": ""})
    assert anonymous.status_code == 401
    assert client.get("/v1/dynsteer/requests/chatcmpl-x").status_code == 404
