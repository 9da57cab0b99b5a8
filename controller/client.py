"""A small client for the ``/v1/dynsteer/`` routes (stdlib only, no vLLM import).

    client = DynsteerClient("http://localhost:8000", api_key="...")
    client.register_vector("calm", vector)
    client.set_global([{"vector": "calm", "layers": [12], "scale": 2.0}])
    client.request("chatcmpl-...")          # how a request was steered + gate telemetry

Per-request steering needs no helper: any OpenAI client passes the spec as
``extra_body={"dynsteer": spec}`` (or ``extra_body={"vllm_xargs": {"dynsteer": json}}``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from dynsteer.probes import Probe

from .activations import Activations, activations_of
from .contract import encode_f32
from .http_models import (
    CapturedArray,
    GlobalCapture,
    GlobalSteering,
    Health,
    ProbeList,
    ProbeSummary,
    RequestReport,
    ServerInfo,
)

PREFIX = "/v1/dynsteer"


class DynsteerHTTPError(RuntimeError):
    """A dynsteer route answered with an error status; ``message`` is the server's text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _error_message(body: bytes) -> str:
    """The message of vLLM's ``{"error": {"message"}}``, FastAPI's ``{"detail"}`` or raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in data:
            return str(data["detail"])
    return json.dumps(data)


def _replace_query(replace: bool) -> str:
    return "?replace=true" if replace else ""


class DynsteerClient:
    """Calls one server's dynsteer routes; every method raises :class:`DynsteerHTTPError`."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request to ``/v1/dynsteer{path}``; returns the decoded JSON answer."""
        return self._send(method, PREFIX + path, body)

    def _send(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise DynsteerHTTPError(e.code, _error_message(e.read())) from None
        return json.loads(raw) if raw else None

    # ---- completions ------------------------------------------------------------------
    def complete(self, body: dict[str, Any]
                 ) -> tuple[dict[str, Any], list[Activations | None]]:
        """POST an OpenAI completion request (with its ``dynsteer`` spec) to
        ``/v1/chat/completions`` when it has ``messages``, else to ``/v1/completions``: the
        response's JSON, and what each choice captured (None: it asked for no capture)."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = self._send("POST", path, body)
        return response, activations_of(response)

    # ---- server -----------------------------------------------------------------------
    def health(self) -> Health:
        return Health.model_validate(self.call("GET", "/health"))

    def info(self) -> ServerInfo:
        return ServerInfo.model_validate(self.call("GET", "/info"))

    # ---- global steering ----------------------------------------------------------------
    def get_global(self) -> GlobalSteering:
        return GlobalSteering.model_validate(self.call("GET", "/global"))

    def set_global(self, entries: Sequence[dict[str, Any]]) -> GlobalSteering:
        return GlobalSteering.model_validate(self.call("PUT", "/global",
                                                      {"steer": list(entries)}))

    def clear_global(self) -> None:
        self.call("DELETE", "/global")

    # ---- named vectors ------------------------------------------------------------------
    def register_vector(self, name: str, vector: Any, *, replace: bool = False) -> None:
        """Register a vector, sent as base64 float32 (HTTP 409 when the name is taken, unless
        ``replace``)."""
        self.call("POST", "/vectors" + _replace_query(replace),
                  {"name": name, "vector_b64": encode_f32(vector)})

    def vectors(self) -> list[str]:
        return list(self.call("GET", "/vectors")["names"])

    def get_vector(self, name: str) -> list[float]:
        return list(self.call("GET", f"/vectors/{name}")["vector"])

    def delete_vector(self, name: str) -> None:
        self.call("DELETE", f"/vectors/{name}")

    # ---- requests -----------------------------------------------------------------------
    def request(self, request_id: str) -> RequestReport:
        """How a recent steered request was steered, and its gate telemetry."""
        return RequestReport.model_validate(self.call("GET", f"/requests/{request_id}"))

    # ---- probes -------------------------------------------------------------------------
    def upload_probe(self, probe: Probe, *, replace: bool = False) -> ProbeSummary:
        """Register ``probe`` under its name; the server checks it fits (HTTP 409 when the name
        is taken, unless ``replace``)."""
        return ProbeSummary.model_validate(
            self.call("POST", "/probes" + _replace_query(replace), probe.to_json_dict()))

    def probes(self) -> list[ProbeSummary]:
        return ProbeList.model_validate(self.call("GET", "/probes")).probes

    def get_probe(self, name: str) -> Probe:
        return Probe.from_json_dict(self.call("GET", f"/probes/{name}"))

    def delete_probe(self, name: str) -> None:
        self.call("DELETE", f"/probes/{name}")

    # ---- activation capture -------------------------------------------------------------
    def capture(self, prompts: Sequence[Sequence[int] | str], sites: str | Sequence[str],
                reduce: str = "last") -> dict[str, Any]:
        """Activations at ``sites`` computed by the served engine: per site an ``[N, H]`` float32
        array (``last``/``mean``) or a list of ``[len_i, H]`` arrays (``all``)."""
        body = {"prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                "sites": sites if isinstance(sites, str) else list(sites), "reduce": reduce}
        out: dict[str, Any] = {}
        for site, value in self.call("POST", "/capture", body).items():
            if isinstance(value, list):
                out[site] = [CapturedArray.model_validate(v).to_numpy() for v in value]
            else:
                out[site] = CapturedArray.model_validate(value).to_numpy()
        return out

    def set_global_capture(self, capture: dict[str, Any], *, session: str | None = None,
                           caller: str | None = None) -> GlobalCapture:
        """Capture every completion that asks for none into a sink (``capture``:
        a ``CaptureSpec`` with ``sink``); only those of ``session`` (as the server names it,
        ``<key namespace><name>`` with API keys) and of the API key whose namespace is
        ``caller``, where given."""
        scope = {k: v for k, v in (("session", session), ("caller", caller)) if v is not None}
        query = f"?{urllib.parse.urlencode(scope)}" if scope else ""
        return GlobalCapture.model_validate(self.call("PUT", "/capture/global" + query,
                                                      capture))

    def get_global_capture(self) -> GlobalCapture:
        return GlobalCapture.model_validate(self.call("GET", "/capture/global"))

    def clear_global_capture(self) -> None:
        self.call("DELETE", "/capture/global")
