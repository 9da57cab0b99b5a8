"""Server-side settings of the dynsteer routes, read from the environment.

``dynsteer serve`` turns its flags into these variables; they also work under a plain
``vllm serve`` with ``VLLM_PLUGINS=dynsteer``. Secrets stay out of ``additional_config`` (which
vLLM logs and hashes into its compile-cache key).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynsteer.controller.spec import SINK_PATTERN

API_KEY_ENV = "DYNSTEER_API_KEY"
MAX_BODY_ENV = "DYNSTEER_MAX_BODY_BYTES"
MAX_REQUEST_ENV = "DYNSTEER_MAX_REQUEST_BYTES"
PROBE_STORE_ENV = "DYNSTEER_PROBE_STORE"
CAPTURE_SINKS_ENV = "DYNSTEER_CAPTURE_SINKS"

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""Default cap of request bodies on vLLM's own routes (32 MiB; generous for chat bodies)."""


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: str | None = None
    """Required (as ``Authorization: Bearer``) by every mutating dynsteer route when set."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request body a dynsteer route accepts (HTTP 413 above)."""
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1024)
    """Largest request body of any other POST/PUT/PATCH route: vLLM's own, completions
    included (HTTP 413 above)."""
    probe_store: Path | None = None
    """Folder where uploaded probes persist across restarts (None: in memory only)."""
    capture_sinks: dict[Annotated[str, Field(pattern=SINK_PATTERN)], str] = Field(
        default_factory=dict)
    """Capture sinks by name: a folder (a filesystem sink, :mod:`dynsteer.capture`), or
    ``@plugin:ARG`` for a sink registered in the entry-point group
    ``dynsteer.capture_sinks`` (called with ARG)."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerSettings:
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        if env.get(API_KEY_ENV):
            raw["api_key"] = env[API_KEY_ENV]
        if env.get(MAX_BODY_ENV):
            raw["max_body_bytes"] = env[MAX_BODY_ENV]
        if env.get(MAX_REQUEST_ENV):
            raw["max_request_bytes"] = env[MAX_REQUEST_ENV]
        if env.get(PROBE_STORE_ENV):
            raw["probe_store"] = env[PROBE_STORE_ENV]
        if env.get(CAPTURE_SINKS_ENV):
            raw["capture_sinks"] = dict(item.partition("=")[::2]
                                        for item in env[CAPTURE_SINKS_ENV].split(","))
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            name = {"api_key": API_KEY_ENV, "max_body_bytes": MAX_BODY_ENV,
                    "max_request_bytes": MAX_REQUEST_ENV,
                    "probe_store": PROBE_STORE_ENV,
                    "capture_sinks": CAPTURE_SINKS_ENV}[str(first["loc"][0])]
            raise ValueError(f"{name}: {first['msg']}") from e


def api_keys(settings: ServerSettings, vllm_api_key: Any) -> list[str]:
    """Keys that may call mutating routes: ours and vLLM's ``--api-key`` (str or list)."""
    keys = [settings.api_key] if settings.api_key else []
    if isinstance(vllm_api_key, str):
        vllm_api_key = [vllm_api_key]
    keys += [k for k in vllm_api_key or () if k]
    if os.environ.get("VLLM_API_KEY"):
        keys.append(os.environ["VLLM_API_KEY"])
    return keys


def is_configured_key(token: str | None, keys: list[str]) -> bool:
    """Whether ``token`` is one of ``keys``, compared in constant time (digests, so neither a
    key's content nor its length leaks through timing)."""
    if not token:
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest())
               for k in keys)
