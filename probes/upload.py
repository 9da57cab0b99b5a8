"""Upload a probe to a running ``dynsteer serve`` (stdlib HTTP, no vLLM import)."""

from __future__ import annotations

from .probe import Probe


def upload(probe: Probe, base_url: str, *, api_key: str | None = None,
           timeout: float = 60.0, replace: bool = False) -> dict:
    """``POST /v1/dynsteer/probes``: register ``probe`` under its name on the server.

    Returns the server's summary of the stored probe. Raises
    :class:`dynsteer.controller.client.DynsteerHTTPError` (status + the server's message) when
    the server rejects it, e.g. a hidden-size or fingerprint mismatch (400), no API key (401)
    or a name that is taken without ``replace`` (409).
    """
    from dynsteer.controller.client import DynsteerClient

    client = DynsteerClient(base_url, api_key=api_key, timeout=timeout)
    return client.upload_probe(probe, replace=replace).model_dump()
