"""Captured activations on disk: the filesystem sink and the reader of a sink's folder.

A :class:`FilesystemSink` takes requests' :class:`~.activations.Activations` (the API server
hands each over once its response is complete) and writes them into safetensors shards and an
index through a :class:`~.capture_shards.ShardWriter`, on a thread of its own behind a bounded
queue (``policy`` ``block`` or ``drop``). The engine's own sinks
(``dynsteer.capture_sinks``) write the same files from the workers while requests run.

A shard holds, per request, one tensor of its rows at each site (as its dtype stores them:
bfloat16 as its bits, int8 with a tensor of per-row scales) and one of its positions;
``index.jsonl`` has a line per request (its id, status, shard, and per site the tensor and row
range). A write that fails (a full disk) drops that request or shard, counts it and logs why;
the caller is never interrupted. See :mod:`.capture_shards` for sealing, and what a killed
process leaves.

:func:`open` reads a folder back: iterate its requests, or read one site across all of them
(each block memory-mapped). The files are ordinary safetensors (``safetensors`` reads them too).
No vLLM import.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .activations import Activations, quantize_int8
from .capture_shards import (
    DEFAULT_SEAL_AFTER_S,
    DEFAULT_SHARD_BYTES,
    INDEX,
    NP_DTYPE,
    Policy,
    ShardCounters,
    ShardThread,
    write_at,
)

logger = logging.getLogger("vllm.dynsteer.capture_store")

SinkCounters = ShardCounters
_CASTS = {"float32": "<f4", "float16": "<f2"}


class FilesystemSink(ShardThread):
    """Writes requests' activations into ``path`` (created if missing)."""

    def __init__(self, path: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 queue_size: int = 64, policy: Policy = "block",
                 seal_after_s: float = DEFAULT_SEAL_AFTER_S) -> None:
        super().__init__(path, shard_bytes, queue_size, policy, seal_after_s)

    def write(self, request_id: str, activations: Activations,
              meta: dict[str, str] | None = None) -> bool:
        """Queue one request's activations (``meta``: kept in its index line, e.g. who sent
        it); False when dropped (queue full under ``drop``)."""
        return self.put((request_id, activations, meta or {}))

    def __enter__(self) -> FilesystemSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, item: tuple[str, Activations, dict[str, str]]) -> None:
        self._add(*item)

    def _add(self, request_id: str, activations: Activations,
             meta: dict[str, str] | None = None) -> None:
        tensors: dict[str, np.ndarray] = {}
        positions = np.asarray(activations.positions, dtype="<i8")
        if len(positions):
            tensors["positions"] = positions
        for site, rows in activations.sites.items():
            for suffix, data in _stored(rows, activations.dtype).items():
                tensors[site + suffix] = data
        line: dict[str, Any] = {"request_id": request_id, "meta": meta or {},
                                "status": activations.status,
                                "detail": activations.detail, "dtype": activations.dtype,
                                "positions": None, "sites": {}}
        reservation = self.writer.reserve(
            {key: (_tensor_name(key, activations.dtype, data), data.dtype, data.shape)
             for key, data in tensors.items()})
        try:
            for key, data in tensors.items():
                self.writer.wrote(reservation, write_at(reservation.fd, data,
                                                        reservation.offsets[key]))
        except OSError as e:
            logger.error("dynsteer: capture sink %s could not write request %s (%s); dropped",
                         self.path, request_id, e)
            self.writer.finish(reservation, None)
            self.counters.dropped += 1
            return
        names = reservation.names
        if len(positions):
            line["positions"] = {"tensor": names["positions"], "start": 0,
                                 "stop": len(positions)}
        for site, rows in activations.sites.items():
            entry = {"tensor": names[site], "start": 0, "stop": len(rows)}
            if site + "/scales" in names:
                entry["scales"] = names[site + "/scales"]
            line["sites"][site] = entry
        self.writer.finish(reservation, line)


_SETTINGS = {"shard_bytes": int, "queue_size": int, "policy": str, "seal_after_s": float}


def sink_settings(name: str, value: str) -> tuple[str, dict[str, Any]]:
    """A configured sink's folder and settings: ``DIR`` or ``DIR?shard_bytes=N&policy=drop
    &seal_after_s=S&queue_size=N`` (ValueError naming the sink and the setting)."""
    folder, _, query = value.partition("?")
    if not folder:
        raise ValueError(f"capture_sinks.{name}: no folder (NAME=DIR[?setting=value&...])")
    settings: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, _, text = item.partition("=")
        if key not in _SETTINGS:
            raise ValueError(f"capture_sinks.{name}: unknown setting {key!r} (one of "
                             f"{', '.join(_SETTINGS)})")
        try:
            settings[key] = _SETTINGS[key](text)
        except ValueError as e:
            raise ValueError(f"capture_sinks.{name}.{key}: {text!r} is not valid") from e
    if settings.get("policy", "block") not in ("block", "drop"):
        raise ValueError(f"capture_sinks.{name}.policy: {settings['policy']!r} is not 'block' "
                         "or 'drop'")
    return folder, settings


def _tensor_name(key: str, dtype: str, data: np.ndarray) -> str:
    """A block's name in its shard (before its number): the site, dtype and row width."""
    if key == "positions":
        return key
    site, _, scales = key.partition("/")
    return f"{site}/{dtype}/scales" if scales else f"{site}/{dtype}/{data.shape[-1]}"


def _stored(rows: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """The tensors one site's rows are kept in, by key suffix: as their dtype holds them
    (bfloat16 as its bits, int8 with its scales)."""
    if dtype == "bfloat16":
        return {"": (np.ascontiguousarray(rows, np.float32).view(np.uint32) >> 16)
                .astype("<u2")}
    if dtype == "int8":
        q, scale = quantize_int8(rows)
        return {"": q, "/scales": np.ascontiguousarray(scale, "<f4")}
    return {"": np.ascontiguousarray(rows, _CASTS[dtype])}


# ---- reading ---------------------------------------------------------------------------------
def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as views of one memory map (bfloat16 as uint16
    bits)."""
    with builtins.open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else None
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(NP_DTYPE[info["dtype"]])
        out[name] = (data[8 + length + begin:8 + length + end].view(dtype)
                     .reshape(info["shape"]) if end > begin and data is not None
                     else np.zeros(info["shape"], dtype))
    return out


def _as_values(rows: np.ndarray, dtype: str, scales: np.ndarray | None) -> np.ndarray:
    if dtype == "bfloat16":
        return (rows.astype(np.uint32) << 16).view(np.float32)
    if dtype == "int8" and scales is not None:
        return rows.astype(np.float32) * scales[:, None]
    return np.asarray(rows)


@dataclass(frozen=True)
class CapturedRequest:
    """One request as the index names it."""

    request_id: str
    status: str
    activations: Activations
    meta: dict[str, str] = field(default_factory=dict)
    """What the writer kept with it (on a server: ``caller``, the namespace of the API key
    that sent it)."""

    def __getitem__(self, site: str) -> np.ndarray:
        return self.activations[site]


class CaptureStore:
    """A sink's folder, read back (:func:`open`). A request written by several workers (one
    per pipeline stage, each with its own layers' sites) has a line from each; it reads as one
    request with all of their sites."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / INDEX
        self.lines = ([json.loads(line) for line in index.read_text("utf-8").splitlines()
                       if line.strip()] if index.exists() else [])
        self._by_request: dict[str, list[dict[str, Any]]] = {}
        for line in self.lines:
            self._by_request.setdefault(line["request_id"], []).append(line)
        self._shards: dict[str, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def __iter__(self) -> Iterator[CapturedRequest]:
        return (self._request(lines) for lines in self._by_request.values())

    def sites(self) -> list[str]:
        return sorted({site for line in self.lines for site in line["sites"]})

    def site(self, site: str) -> np.ndarray:
        """Every request's rows at ``site``, in index order: ``[tokens, width]`` (one request's
        is a memory map; several are concatenated)."""
        parts = [self._rows(line, site) for line in self.lines if site in line["sites"]]
        if not parts:
            raise KeyError(f"site: {site!r} is not in {self.path} (it has {self.sites()})")
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _shard(self, name: str) -> dict[str, np.ndarray]:
        if name not in self._shards:
            self._shards[name] = _tensors(self.path / name)
        return self._shards[name]

    def _rows(self, line: dict[str, Any], site: str) -> np.ndarray:
        entry = line["sites"][site]
        tensors = self._shard(line["shard"])
        rows = tensors[entry["tensor"]][entry["start"]:entry["stop"]]
        scales = tensors[entry["scales"]][entry["start"]:entry["stop"]] \
            if "scales" in entry else None
        return _as_values(rows, line["dtype"], scales)

    def _request(self, lines: list[dict[str, Any]]) -> CapturedRequest:
        first = lines[0]
        found = first["positions"]
        positions = (self._shard(first["shard"])[found["tensor"]][found["start"]:found["stop"]]
                     if found else np.zeros(0, np.int64))
        sites = {site: self._rows(line, site) for line in lines for site in line["sites"]}
        status = next((line["status"] for line in lines if line["status"] != "ok"),
                      first["status"])
        activations = Activations(status=status, detail=first.get("detail", ""),
                                  dtype=first["dtype"], positions=np.asarray(positions),
                                  sites=sites)
        return CapturedRequest(first["request_id"], status, activations,
                               first.get("meta", {}))


def open(path: str | os.PathLike[str]) -> CaptureStore:
    """Read a sink's folder: ``for request in store``, or ``store.site("post_block@12")``."""
    return CaptureStore(Path(path))
