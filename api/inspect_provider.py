"""An Inspect AI model provider: ``dynsteer/<model>`` evaluates a `dynsteer serve`.

Installed with the package (entry point group ``inspect_ai``), so Inspect finds it by name::

    inspect eval task.py --model dynsteer/default --model-base-url http://127.0.0.1:8000
    inspect eval task.py --model dynsteer/default -M serve=true     # starts a server itself

Steering travels per call, as a chat completion's ``dynsteer`` body field: a task or a
``generate()`` step sets it with ``GenerateConfig(extra_body={"dynsteer": spec})``; ``-M
spec=...`` (a spec, or JSON text of one) is the default for calls that set none. Each sample's
output carries what the server says about its request in ``ModelOutput.metadata["dynsteer"]``:
``telemetry`` (gate counts, first gated position, max score, per-token gates when the gate
traces; ``GET /v1/dynsteer/requests/{id}``) for a request with a gate, and ``activations``
(the completion's own, as JSON) for one whose spec captures.

Model arguments (``-M``): ``spec``; ``serve`` (start ``dynsteer serve`` on loopback for the
model, ``default`` being the embedded one, stopped when Inspect closes the model);
``serve_args`` (more arguments for it, a list or one string); ``timeout`` (seconds per call,
default 600). The server's URL is ``--model-base-url`` or ``$DYNSTEER_BASE_URL``, its API key
``--model-api-key`` or ``$DYNSTEER_API_KEY``. Tools are not supported.

Needs ``inspect_ai`` (``pip install 'dynsteer[inspect]'``); no vLLM import.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

import httpx
from inspect_ai.model import (
    ChatMessage,
    GenerateConfig,
    ModelAPI,
    ModelCall,
    ModelOutput,
    ModelUsage,
    modelapi,
)
from inspect_ai.tool import ToolChoice, ToolInfo

BASE_URL = "DYNSTEER_BASE_URL"
API_KEY = "DYNSTEER_API_KEY"
DEFAULT_MODEL = "default"
"""The model name that serves the embedded default model (``dynsteer serve`` without MODEL)."""
_STOPS = {"stop": "stop", "length": "max_tokens", "content_filter": "content_filter"}
KEEPALIVE_S = 2.0
"""How long an idle pooled connection is kept: less than the server's keep-alive (vLLM's
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s), so a connection is never reused just as the server
closes it (the request would fail with a read error)."""


@modelapi(name="dynsteer")
class DynsteerAPI(ModelAPI):
    """Chat completions from a `dynsteer serve`, with the steering spec of each call."""

    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 config: GenerateConfig | None = None, **model_args: Any) -> None:
        super().__init__(model_name, base_url=base_url or os.environ.get(BASE_URL),
                         api_key=api_key or os.environ.get(API_KEY), api_key_vars=[API_KEY],
                         config=config or GenerateConfig())
        unknown = set(model_args) - {"spec", "serve", "serve_args", "timeout"}
        if unknown:
            raise ValueError(f"dynsteer model args: {sorted(unknown)} unknown (spec, serve, "
                             "serve_args, timeout)")
        spec = model_args.get("spec")
        self.spec: dict[str, Any] | None = json.loads(spec) if isinstance(spec, str) else spec
        self._server: Any = None
        if _truthy(model_args.get("serve")):
            self.base_url = self._start(model_args.get("serve_args"))
        if not self.base_url:
            raise ValueError(f"dynsteer/{model_name}: give the server's URL (--model-base-url "
                             f"or ${BASE_URL}), or -M serve=true to start one")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=float(model_args.get("timeout", 600)),
                                       limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        self._served_name: str | None = None

    async def generate(self, input: list[ChatMessage], tools: list[ToolInfo],
                       tool_choice: ToolChoice, config: GenerateConfig
                       ) -> tuple[ModelOutput | Exception, ModelCall]:
        if tools:
            raise ValueError("dynsteer/: tools are not supported")
        request = await self._request(input, config)
        reply = await self._http.post("/v1/chat/completions", json=request)
        if reply.status_code >= 400:
            return RuntimeError(f"dynsteer serve answered {reply.status_code}: "
                                f"{reply.text[:500]}"), ModelCall.create(request, reply.text)
        body = reply.json()
        choice = body["choices"][0]
        output = ModelOutput.from_content(
            body.get("model", self.model_name), choice["message"].get("content") or "",
            stop_reason=_STOPS.get(choice.get("finish_reason"), "unknown"))
        usage = body.get("usage") or {}
        output.usage = ModelUsage(input_tokens=usage.get("prompt_tokens", 0),
                                  output_tokens=usage.get("completion_tokens", 0),
                                  total_tokens=usage.get("total_tokens", 0))
        output.metadata = {"dynsteer": await self._report(body, request.get("dynsteer"))}
        return output, ModelCall.create(request, body)

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def max_tokens(self) -> int | None:
        return 256

    def should_retry(self, ex: Exception) -> bool:
        """A call whose connection failed (refused, reset, closed before the reply) is tried
        again with Inspect's backoff; an HTTP error reply is not."""
        return isinstance(ex, httpx.TransportError) and not isinstance(ex, httpx.TimeoutException)

    def max_connections(self) -> int:
        return 16

    async def _request(self, input: list[ChatMessage], config: GenerateConfig
                       ) -> dict[str, Any]:
        """The chat completion's body: messages, sampling, and the spec (the call's, else the
        model's default)."""
        request: dict[str, Any] = {
            "model": await self._model(),
            "messages": [{"role": m.role, "content": m.text} for m in input]}
        for ours, theirs in (("max_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("seed", "seed"), ("stop_seqs", "stop")):
            value = getattr(config, ours)
            if value is not None:
                request[theirs] = value
        extra = dict(config.extra_body or {})
        if "dynsteer" not in extra and self.spec is not None:
            extra["dynsteer"] = self.spec
        return {**request, **extra}

    async def _model(self) -> str:
        """The name the server serves its model under (asked once)."""
        if self._served_name is None:
            reply = await self._http.get("/v1/models")
            reply.raise_for_status()
            self._served_name = reply.json()["data"][0]["id"]
        return self._served_name

    async def _report(self, body: dict[str, Any], spec: Any) -> dict[str, Any]:
        """What the server says about the request: its gate telemetry and its activations."""
        report: dict[str, Any] = {"spec": spec, "telemetry": None, "activations": None}
        if isinstance(spec, dict) and spec.get("gate") is not None:
            reply = await self._http.get(f"/v1/dynsteer/requests/{body['id']}")
            if reply.status_code == 200:
                report["telemetry"] = reply.json().get("telemetry")
        found = (body.get("dynsteer") or {}).get("activations")
        if found is not None:
            report["activations"] = found[0] if len(found) == 1 else found
        return report

    def _start(self, serve_args: Any) -> str:
        """Start `dynsteer serve` for this model on loopback; its URL."""
        from dynsteer.controller.launch import ServerProcess

        extra = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args or [])
        model = [] if self.model_name == DEFAULT_MODEL else [self.model_name]
        log = Path(tempfile.mkdtemp(prefix="dynsteer-inspect-")) / "serve.log"
        self._server = ServerProcess([*model, *extra], log)
        self._server.wait_ready(api_key=self.api_key)
        return str(self._server.url)


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")
