"""Captured activations on disk: safetensors shards and an index, written while serving.

A :class:`FilesystemSink` takes requests' :class:`~.activations.Activations` and packs them
into shards: one safetensors file holds, per (site, dtype, row width), one tensor of the rows
of every request in it, one after the other, and one int64 tensor of their positions. A shard
is *sealed* once it holds ``shard_bytes``, has been open ``seal_after_s``, or the sink is
flushed or closed: written
under a hidden temporary name, synced, renamed into place, and only then named in
``index.jsonl``, one line per request (its id, status, shard, and per site the tensor and row
range). A process killed mid-way leaves sealed shards, an index that names only them, and at
most one hidden temporary file, which readers ignore.

Writes go through a bounded queue to one writer thread, so a caller never waits for the disk
unless the queue is full: ``policy="block"`` then waits, ``"drop"`` drops the request and
counts it. A write that fails (a full disk) drops that shard's requests, counts them and logs
why; the caller is never interrupted.

:func:`open` reads a folder back: iterate its requests, or read one site across all of them
(each shard's tensor memory-mapped). The files are ordinary safetensors (``safetensors``
reads them too). No vLLM import.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .activations import Activations, quantize_int8

logger = logging.getLogger("vllm.dynsteer.capture_store")

INDEX = "index.jsonl"
DEFAULT_SHARD_BYTES = 256 << 20
DEFAULT_SEAL_AFTER_S = 60.0
"""A shard open this long with something in it is sealed, full or not (so a quiet server's
rows reach the disk)."""
_ST_OF = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<u2"): "BF16",
          np.dtype("i1"): "I8", np.dtype("<i8"): "I64"}
"""The safetensors dtype of each stored numpy dtype (bfloat16 rows are kept as their bits)."""
_NP_OF_ST = {st: np_dtype for np_dtype, st in _ST_OF.items()}
_CASTS = {"float32": "<f4", "float16": "<f2"}
Policy = Literal["block", "drop"]


@dataclass
class SinkCounters:
    """What a sink did (exported as metrics by the server)."""

    requests: int = 0
    """Requests written into sealed shards."""
    dropped: int = 0
    """Requests dropped (queue full under ``drop``, or a failed write)."""
    bytes: int = 0
    """Bytes of sealed shards."""
    shards: int = 0


@dataclass
class _Open:
    """The shard being filled: per tensor, its parts; per request, its index line."""

    tensors: dict[str, list[np.ndarray]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    lines: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    since: float = field(default_factory=time.monotonic)

    def append(self, name: str, array: np.ndarray) -> int:
        """Add rows to tensor ``name``; returns the first row's index in it."""
        start = self.rows.get(name, 0)
        self.tensors.setdefault(name, []).append(array)
        self.rows[name] = start + len(array)
        self.nbytes += array.nbytes
        return start


class FilesystemSink:
    """Writes requests' activations into ``path`` (created if missing)."""

    def __init__(self, path: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 queue_size: int = 64, policy: Policy = "block",
                 seal_after_s: float = DEFAULT_SEAL_AFTER_S) -> None:
        if policy not in ("block", "drop"):
            raise ValueError(f"policy: {policy!r} is not 'block' or 'drop'")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.seal_after_s = seal_after_s
        self.policy = policy
        self.counters = SinkCounters()
        self._queue: queue.Queue[tuple[str, Activations, dict[str, str]] | None] = \
            queue.Queue(queue_size)
        self._open = _Open()
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in self.path.glob("shard-*")),
                             default=0)
        self._thread = threading.Thread(target=self._run, name="dynsteer-capture-sink",
                                        daemon=True)
        self._thread.start()

    def write(self, request_id: str, activations: Activations,
              meta: dict[str, str] | None = None) -> bool:
        """Queue one request's activations (``meta``: kept in its index line, e.g. who sent
        it); False when dropped (queue full under ``drop``)."""
        try:
            self._queue.put((request_id, activations, meta or {}),
                            block=self.policy == "block")
        except queue.Full:
            self.counters.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until everything queued is in a sealed shard."""
        self._queue.put(("", _SEAL, {}))
        self._queue.join()

    def close(self) -> None:
        """Seal what is open and stop the writer."""
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> FilesystemSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.seal_after_s / 4)
            except queue.Empty:
                if self._open.lines and time.monotonic() - self._open.since > self.seal_after_s:
                    self._seal()
                continue
            try:
                if item is None:
                    return
                request_id, activations, meta = item
                if activations is _SEAL:
                    self._seal()
                else:
                    self._add(request_id, activations, meta)
                    if self._open.nbytes >= self.shard_bytes:
                        self._seal()
            finally:
                self._queue.task_done()

    def _add(self, request_id: str, activations: Activations,
             meta: dict[str, str] | None = None) -> None:
        shard = self._open
        positions = np.asarray(activations.positions, dtype=np.int64)
        line: dict[str, Any] = {"request_id": request_id, "meta": meta or {},
                                "status": activations.status,
                                "detail": activations.detail, "dtype": activations.dtype,
                                "positions": None, "sites": {}}
        if len(positions):
            start = shard.append("positions", positions)
            line["positions"] = {"tensor": "positions", "start": start,
                                 "stop": start + len(positions)}
        for site, rows in activations.sites.items():
            entry: dict[str, Any] = {}
            for name, data in _stored(site, rows, activations.dtype).items():
                start = shard.append(name, data)  # the scales keep pace with their rows
                entry["scales" if name.endswith("/scales") else "tensor"] = name
            line["sites"][site] = {**entry, "start": start, "stop": start + len(rows)}
        shard.lines.append(line)

    def _seal(self) -> None:
        shard, self._open = self._open, _Open()
        if not shard.lines:
            return
        name = f"shard-{self._next:06d}.safetensors"
        self._next += 1
        temporary = self.path / f".{name}.tmp"
        try:
            size = _write_safetensors(temporary, shard.tensors)
            os.replace(temporary, self.path / name)
            with builtins.open(self.path / INDEX, "a", encoding="utf-8") as index:
                for line in shard.lines:
                    index.write(json.dumps({**line, "shard": name}) + "\n")
                index.flush()
                os.fsync(index.fileno())
        except OSError as e:
            logger.error("dynsteer: capture sink %s could not write %s (%s); %d requests "
                         "dropped", self.path, name, e, len(shard.lines))
            self.counters.dropped += len(shard.lines)
            temporary.unlink(missing_ok=True)
            return
        self.counters.requests += len(shard.lines)
        self.counters.bytes += size
        self.counters.shards += 1


_SEAL: Any = object()


def _stored(site: str, rows: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """The tensors one site's rows are kept in: as their dtype holds them (bfloat16 as its
    bits, int8 with its scales), in a tensor per (site, dtype, width)."""
    name = f"{site}/{dtype}/{rows.shape[-1]}"
    if dtype == "bfloat16":
        return {name: (np.ascontiguousarray(rows, np.float32).view(np.uint32) >> 16)
                .astype(np.uint16)}
    if dtype == "int8":
        q, scale = quantize_int8(rows)
        return {name: q, f"{name}/scales": scale}
    return {name: np.ascontiguousarray(rows, _CASTS[dtype])}


def _write_safetensors(path: Path, tensors: dict[str, list[np.ndarray]]) -> int:
    """Write ``tensors`` (each the concatenation of its parts along the first axis) as one
    safetensors file, synced; returns its size. The parts go to the file as they are, not
    joined in memory first."""
    header: dict[str, Any] = {"__metadata__": {"format": "dynsteer-capture"}}
    offset = 0
    for name, parts in tensors.items():
        nbytes = sum(part.nbytes for part in parts)
        header[name] = {"dtype": _ST_OF[parts[0].dtype.newbyteorder("<")],
                        "shape": [sum(len(part) for part in parts), *parts[0].shape[1:]],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with builtins.open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for parts in tensors.values():
            for part in parts:
                out.write(memoryview(np.ascontiguousarray(part)).cast("B"))
        out.flush()
        os.fsync(out.fileno())
    return 8 + len(text) + offset


# ---- reading ---------------------------------------------------------------------------------
def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, memory-mapped (bfloat16 as uint16 bits)."""
    with builtins.open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(_NP_OF_ST[info["dtype"]])
        count = (end - begin) // dtype.itemsize
        out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + length + begin,
                              shape=(count,)).reshape(info["shape"]) if count else \
            np.zeros(info["shape"], dtype)
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
    """A sink's folder, read back (:func:`open`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / INDEX
        self.lines = ([json.loads(line) for line in index.read_text("utf-8").splitlines()
                       if line.strip()] if index.exists() else [])
        self._shards: dict[str, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self) -> Iterator[CapturedRequest]:
        return (self._request(line) for line in self.lines)

    def sites(self) -> list[str]:
        return sorted({site for line in self.lines for site in line["sites"]})

    def site(self, site: str) -> np.ndarray:
        """Every request's rows at ``site``, in index order: ``[tokens, width]`` (one shard's
        worth is a memory map; several are concatenated)."""
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

    def _request(self, line: dict[str, Any]) -> CapturedRequest:
        found = line["positions"]
        positions = (self._shard(line["shard"])["positions"][found["start"]:found["stop"]]
                     if found else np.zeros(0, np.int64))
        activations = Activations(status=line["status"], detail=line.get("detail", ""),
                                  dtype=line["dtype"], positions=np.asarray(positions),
                                  sites={site: self._rows(line, site) for site in line["sites"]})
        return CapturedRequest(line["request_id"], line["status"], activations,
                               line.get("meta", {}))


def open(path: str | os.PathLike[str]) -> CaptureStore:
    """Read a sink's folder: ``for request in store``, or ``store.site("post_block@12")``."""
    return CaptureStore(Path(path))
