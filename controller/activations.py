"""A request's captured activations, as Python returns them and as HTTP carries them.

The engine returns what a request's spec ``capture`` asked for (see ``docs/capture.md``): the
positions it captured and, per site, the rows ``[positions, hidden]``. Offline,
``Steering.activations(output)`` gives an :class:`Activations`; over HTTP a non-streaming
completion's JSON carries one per choice under ``dynsteer.activations`` (:func:`to_json`),
which :func:`activations_of` reads back from the response (a dict, or an ``openai`` client's
response object). No vLLM import.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Status = Literal["ok", "skipped", "partial", "dropped"]
"""``ok``: every named position was captured; ``skipped``: the capture was conditional
(``when: "gated"``) and the gate never fired, so nothing was kept; ``partial``: some positions
were not captured (``detail`` says which); ``dropped``: nothing was (no free rows or lanes when
the request ran, or its rows were reused before they were collected)."""
STATUSES: tuple[Status, ...] = ("ok", "skipped", "partial", "dropped")
"""From best to worst."""

_BITS = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
"""How each dtype's values travel: bfloat16 as its 16 bits."""


@dataclass(frozen=True)
class Activations:
    """A request's captured activations."""

    status: Status
    positions: np.ndarray
    """The positions captured (int64, ascending): the rows of every site's array."""
    sites: dict[str, np.ndarray]
    """Per site (``hook@layer``): ``[len(positions), hidden]``; float16 for ``float16``,
    float32 otherwise (holding the bfloat16 values for ``bfloat16``)."""
    dtype: str
    detail: str = ""
    """Why the status is not ``ok``."""

    def __getitem__(self, site: str) -> np.ndarray:
        return self.sites[site]


def rows_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Rows sent as little-endian ``dtype`` bytes (:data:`_BITS`) as a numpy array."""
    raw = np.frombuffer(data, dtype=_BITS[dtype]).reshape(shape)
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(raw.dtype.newbyteorder("="))


def rows_to_bytes(rows: np.ndarray, dtype: str) -> bytes:
    """Inverse of :func:`rows_from_bytes` (bfloat16 rows are float32 holding bfloat16 values)."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(rows, np.float32).view(np.uint32) >> 16).astype(
            "<u2").tobytes()
    return np.ascontiguousarray(rows, _BITS[dtype]).tobytes()


def merge(parts: list[Activations]) -> Activations | None:
    """One result from several workers' (a pipeline stage replies with its own layers' sites):
    the worst status, every site."""
    if not parts:
        return None
    worst = max(parts, key=lambda a: STATUSES.index(a.status))
    sites = {site: rows for part in parts for site, rows in part.sites.items()}
    return Activations(status=worst.status, positions=worst.positions, sites=sites,
                       dtype=worst.dtype, detail=worst.detail)


def to_json(activations: Activations | None) -> dict[str, Any] | None:
    """JSON-safe form: positions as a list, each site's rows as base64 of little-endian bytes
    of ``dtype`` (bfloat16 as its 16 bits) with their shape."""
    if activations is None:
        return None
    dtype = activations.dtype
    return {"status": activations.status, "detail": activations.detail, "dtype": dtype,
            "positions": activations.positions.tolist(),
            "sites": {site: {"shape": list(rows.shape),
                             "data": base64.b64encode(rows_to_bytes(rows, dtype)).decode()}
                      for site, rows in activations.sites.items()}}


def from_json(data: dict[str, Any] | None) -> Activations | None:
    """Inverse of :func:`to_json`."""
    if data is None:
        return None
    dtype = data["dtype"]
    if dtype not in _BITS:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_BITS)}")
    sites = {site: rows_from_bytes(base64.b64decode(item["data"]), dtype,
                                   tuple(item["shape"]))
             for site, item in data["sites"].items()}
    return Activations(status=data["status"], detail=data.get("detail", ""), dtype=dtype,
                       positions=np.asarray(data["positions"], dtype=np.int64), sites=sites)


def activations_of(response: Any) -> list[Activations | None]:
    """Per choice of a completion response (its JSON dict, or an ``openai`` client's response
    object): what it captured, None for a choice of a request that asked for no capture."""
    if hasattr(response, "model_dump"):
        response = response.model_dump()
    found = (response.get("dynsteer") or {}).get("activations")
    if found is None:
        return [None] * len(response.get("choices", []))
    return [from_json(item) for item in found]
