"""A request's captured activations, as Python returns them and as HTTP carries them.

The engine returns what a request's spec ``capture`` asked for (see ``docs/capture.md``): the
positions it captured and, per site, the rows ``[positions, hidden]``. Offline,
``Steering.activations(output)`` gives an :class:`Activations`; over HTTP a completion's JSON
(a stream's ``dynsteer.activations`` events) carries one per choice under
``dynsteer.activations`` (:func:`to_json`), which :func:`activations_of` reads back from
the response (a dict, or an ``openai`` client's response object), and
:func:`activations_of_stream` from a stream's chunks. No vLLM import.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
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

_BITS = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int8": "i1"}
"""How each dtype's values travel: bfloat16 as its 16 bits, int8 with a float32 scale per
row."""


def projection_matrix(seed: int, hidden: int, k: int) -> np.ndarray:
    """The random projection a capture's ``project: {"k", "seed"}`` applies (``rows @ M``):
    ``[hidden, k]`` float32, standard normal entries from ``numpy.random.default_rng(seed)``
    divided by ``sqrt(k)``, so a projected row's squared norm is the row's in expectation and
    within ``1 ± eps`` of it with probability at least ``1 - 2 exp(-k eps^2 / 8)``."""
    matrix = np.random.default_rng(seed).standard_normal((hidden, k), dtype=np.float32)
    return matrix / np.float32(np.sqrt(k))


def quantize_int8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 rows, float32 scale per row): ``scale = max |row| / 127`` (1 for a zero row),
    ``q = round(row / scale)``; ``q * scale`` is within ``scale / 2`` of each value."""
    rows = np.asarray(rows, np.float32)
    scale = np.abs(rows).max(axis=-1, initial=0.0) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    return np.clip(np.rint(rows / scale[..., None]), -127, 127).astype(np.int8), scale


@dataclass(frozen=True)
class Activations:
    """A request's captured activations."""

    status: Status
    positions: np.ndarray
    """The positions captured (int64, ascending): the rows of every site's array."""
    sites: dict[str, np.ndarray]
    """Per site (``hook@layer``): ``[len(positions), hidden]`` (one row, their mean, with the
    capture's ``reduce: "mean"``; ``k`` columns when projected);
    float16 for ``float16``, float32 otherwise (the bfloat16 values for ``bfloat16``, the
    dequantized values for ``int8``)."""
    dtype: str
    detail: str = ""
    """Why the status is not ``ok``."""

    def __getitem__(self, site: str) -> np.ndarray:
        return self.sites[site]


def value_bytes(dtype: str) -> int:
    """Bytes of one value of rows sent as ``dtype`` (an int8 row also sends a float32 scale)."""
    return np.dtype(_BITS[dtype]).itemsize


def rows_from_bytes(data: bytes | np.ndarray, dtype: str, shape: tuple[int, ...],
                    scales: bytes = b"") -> np.ndarray:
    """Rows sent as little-endian ``dtype`` bytes (:data:`_BITS`) as a numpy array: float16
    for ``float16``, float32 otherwise (bfloat16 values; int8 rows times their ``scales``).
    Writable: a view of ``data`` where that is writable (a mapped reply), else a copy."""
    raw = np.frombuffer(data, dtype=_BITS[dtype]).reshape(shape)
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "int8":
        scale = np.frombuffer(scales, dtype="<f4").reshape(shape[:-1])
        return raw.astype(np.float32) * scale[..., None].astype(np.float32)
    return raw.astype(raw.dtype.newbyteorder("="), copy=not raw.flags.writeable)


def rows_to_bytes(rows: np.ndarray, dtype: str) -> tuple[bytes, bytes]:
    """Inverse of :func:`rows_from_bytes`: (data, scales)."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(rows, np.float32).view(np.uint32) >> 16).astype(
            "<u2").tobytes(), b""
    if dtype == "int8":
        q, scale = quantize_int8(rows)
        return q.tobytes(), scale.astype("<f4").tobytes()
    return np.ascontiguousarray(rows, _BITS[dtype]).tobytes(), b""


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
    of ``dtype`` (bfloat16 as its 16 bits; int8 with ``scales``, base64 float32) and their
    shape."""
    if activations is None:
        return None
    dtype = activations.dtype
    sites = {}
    for site, rows in activations.sites.items():
        data, scales = rows_to_bytes(rows, dtype)
        sites[site] = {"shape": list(rows.shape), "data": base64.b64encode(data).decode()}
        if scales:
            sites[site]["scales"] = base64.b64encode(scales).decode()
    return {"status": activations.status, "detail": activations.detail, "dtype": dtype,
            "positions": activations.positions.tolist(), "sites": sites}


def from_json(data: dict[str, Any] | None) -> Activations | None:
    """Inverse of :func:`to_json`."""
    if data is None:
        return None
    dtype = data["dtype"]
    if dtype not in _BITS:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(_BITS)}")
    sites = {site: rows_from_bytes(base64.b64decode(item["data"]), dtype,
                                   tuple(item["shape"]),
                                   base64.b64decode(item.get("scales", "")))
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


def activations_of_stream(chunks: Iterable[Any]) -> dict[int, Activations | None]:
    """Per choice index of a streamed completion (its chunks: JSON dicts of the events, or an
    ``openai`` client's chunk objects), what it captured: the rows of all its
    ``dynsteer.activations`` events joined in position order, the worst status."""
    parts: dict[int, list[Activations | None]] = {}
    for chunk in chunks:
        if hasattr(chunk, "model_dump"):
            chunk = chunk.model_dump()
        for at, item in enumerate((chunk.get("dynsteer") or {}).get("activations") or ()):
            index = at if item is None else int(item.get("index", at))
            parts.setdefault(index, []).append(from_json(item))
    return {index: join([p for p in found if p is not None]) for index, found in parts.items()}


def join(parts: list[Activations]) -> Activations | None:
    """One result from parts of a request's positions (a stream's events): their positions
    and rows one after the other, the worst status."""
    if not parts:
        return None
    worst = max(parts, key=lambda a: STATUSES.index(a.status))
    names = dict.fromkeys(site for part in parts for site in part.sites)
    sites = {site: np.concatenate([p.sites[site] for p in parts if site in p.sites])
             for site in names}
    return Activations(status=worst.status, detail=worst.detail, dtype=worst.dtype,
                       positions=np.concatenate([p.positions for p in parts]), sites=sites)
