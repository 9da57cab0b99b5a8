"""Capture shards being filled: safetensors files whose rows arrive in pieces, and their index.

Both capture sinks write through a :class:`ShardWriter`: the filesystem sink
(:class:`~.capture_store.FilesystemSink`, whole requests handed over by the API server) and the
engine's own sinks (rows written by the workers while requests still run). A request's tensors
(its rows at each site, its positions, int8 scales) are *blocks* of the open shard, reserved at
their full size when the request's first rows arrive and filled at their offsets as the rows
come, so a request still generating never holds a shard's bytes back from the disk.

A shard is a hidden ``.NAME.tmp`` file whose data starts after a fixed header room. It takes new
blocks until it holds ``shard_bytes`` (or its header room is used up, or it has been open
``seal_after_s``), and it is *sealed* once it takes no more and every request with a block in it
is finished: its header is written at the front (padded with spaces, as the safetensors format
allows), the file is synced and renamed to ``NAME``, and only then are its requests' lines
appended to ``index.jsonl`` (their id, status, shard and, per site, the tensor and row range).
While a shard fills, its bytes are synced every :data:`SYNC_BYTES` by a thread of its own, so
sealing a large shard does not wait for the disk. A process killed mid-way leaves sealed shards,
an index naming only them, and hidden temporary files, which readers ignore.

Reserved rows a request did not fill (it stopped before ``max_tokens``, or its first positions
came from the prefix cache) read as zeros and lie outside its index line's row range. No vLLM
import.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

logger = logging.getLogger("vllm.dynsteer.capture_shards")

INDEX = "index.jsonl"
DEFAULT_SHARD_BYTES = 256 << 20
DEFAULT_SEAL_AFTER_S = 60.0
"""A shard open this long takes no new requests, and is sealed once those it has finish (so a
quiet server's rows reach the disk)."""
SYNC_BYTES = 16 << 20
"""Bytes written into a shard between two background syncs."""
ST_DTYPE = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<u2"): "BF16",
            np.dtype("i1"): "I8", np.dtype("<i8"): "I64"}
"""The safetensors dtype of each stored numpy dtype (bfloat16 rows are kept as their bits)."""
NP_DTYPE = {st: np_dtype for np_dtype, st in ST_DTYPE.items()}


def header_room(shard_bytes: int) -> int:
    """Bytes a shard keeps for its header (the length and the JSON): 1/64 of the shard, at
    least 4 KiB and at most 1 MiB."""
    return min(1 << 20, max(4096, shard_bytes // 64))


@dataclass
class _Shard:
    """A shard that is not sealed yet."""

    name: str
    fd: int
    temporary: Path
    room: int
    header: dict[str, Any] = field(default_factory=dict)
    header_len: int = 64
    """What the header's JSON takes so far (an upper bound)."""
    data_bytes: int = 0
    written: int = 0
    unsynced: int = 0
    pending: int = 0
    """Requests with a block here that are not finished."""
    lines: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False
    """Takes no new blocks."""
    since: float = field(default_factory=time.monotonic)
    syncs: list[Future[None]] = field(default_factory=list)


@dataclass
class Reservation:
    """One request's blocks: per tensor key, its name in the shard and its first byte in the
    file."""

    shard: _Shard
    names: dict[str, str]
    offsets: dict[str, int]

    @property
    def fd(self) -> int:
        return self.shard.fd


@dataclass
class ShardCounters:
    """What a writer did (the server exports them as metrics)."""

    requests: int = 0
    """Requests named in the index of a sealed shard."""
    dropped: int = 0
    """Requests lost (queue full under ``drop``, a failed write)."""
    bytes: int = 0
    """Bytes of sealed shards."""
    shards: int = 0


class ShardWriter:
    """Shards in ``path`` (created if missing), named ``shard-{tag}NNNNNN.safetensors``. Not
    thread-safe: one thread reserves, writes, finishes and seals."""

    def __init__(self, path: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 seal_after_s: float = DEFAULT_SEAL_AFTER_S, tag: str = "") -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.seal_after_s = seal_after_s
        self.tag = tag
        self.counters = ShardCounters()
        prefix = f"shard-{tag}"
        self._next = 1 + max((int(p.name[len(prefix):].split(".")[0])
                              for p in self.path.glob(f"{prefix}*.safetensors")
                              if p.name[len(prefix):].split(".")[0].isdigit()), default=0)
        self._open: _Shard | None = None
        self._unsealed: list[_Shard] = []
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="dynsteer-shard-sync")

    def reserve(self, tensors: dict[str, tuple[str, np.dtype, tuple[int, ...]]]
                ) -> Reservation:
        """Blocks for one request's tensors: per key, (the tensor's name prefix, its dtype,
        its shape). All of them are in the open shard (a new one when they do not fit)."""
        entries = {key: (prefix, np.dtype(dtype), tuple(int(n) for n in shape))
                   for key, (prefix, dtype, shape) in tensors.items()}
        size = sum(int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in entries.values())
        shard = self._open
        if shard is None or shard.closed or not self._fits(shard, entries, size):
            shard = self._start()
        names: dict[str, str] = {}
        offsets: dict[str, int] = {}
        for key, (prefix, dtype, shape) in entries.items():
            name = f"{prefix}/{len(shard.header)}"
            nbytes = int(np.prod(shape)) * dtype.itemsize
            entry = {"dtype": ST_DTYPE[dtype.newbyteorder("<")], "shape": list(shape),
                     "data_offsets": [shard.data_bytes, shard.data_bytes + nbytes]}
            shard.header[name] = entry
            shard.header_len += len(json.dumps({name: entry})) - 1
            names[key] = name
            offsets[key] = shard.room + shard.data_bytes
            shard.data_bytes += nbytes
        shard.pending += 1
        if shard.data_bytes >= self.shard_bytes:
            shard.closed = True
        return Reservation(shard, names, offsets)

    def wrote(self, reservation: Reservation, nbytes: int) -> None:
        """``nbytes`` were written into ``reservation``'s blocks (they are synced in the
        background every :data:`SYNC_BYTES`)."""
        shard = reservation.shard
        shard.written += nbytes
        shard.unsynced += nbytes
        if shard.unsynced >= SYNC_BYTES:
            shard.unsynced = 0
            shard.syncs = [s for s in shard.syncs if not s.done()]
            shard.syncs.append(self._syncer.submit(os.fdatasync, shard.fd))

    def finish(self, reservation: Reservation, line: dict[str, Any] | None) -> None:
        """The request is finished: ``line`` (its index line; None: it is dropped) goes into the
        index when its shard is sealed."""
        shard = reservation.shard
        shard.pending -= 1
        if line is not None:
            shard.lines.append({**line, "shard": shard.name})

    def seal(self, force: bool = False) -> None:
        """Seal every shard that is ready: it takes no more blocks (with ``force``, or open
        ``seal_after_s``, the open shard stops taking them) and its requests are finished."""
        shard = self._open
        if shard is not None and (force or time.monotonic() - shard.since > self.seal_after_s):
            shard.closed = True
        while self._unsealed and self._unsealed[0].closed and not self._unsealed[0].pending:
            self._seal(self._unsealed.pop(0))

    def abandon(self) -> int:
        """Stop without sealing what has unfinished requests (they are counted dropped);
        returns how many."""
        self.seal(force=True)
        lost = 0
        for shard in self._unsealed:
            lost += shard.pending + len(shard.lines)
            self._close(shard)
            shard.temporary.unlink(missing_ok=True)
        self.counters.dropped += lost
        self._unsealed.clear()
        self._open = None
        return lost

    # ---- internals -----------------------------------------------------------------------
    def _fits(self, shard: _Shard, entries: dict[str, tuple[str, np.dtype, tuple[int, ...]]],
              size: int) -> bool:
        more = sum(len(prefix) + 120 for prefix, _, _ in entries.values())
        if shard.header_len + more > shard.room - 8:
            return False
        return not shard.header or shard.data_bytes + size <= self.shard_bytes

    def _start(self) -> _Shard:
        if self._open is not None:
            self._open.closed = True
        name = f"shard-{self.tag}{self._next:06d}.safetensors"
        self._next += 1
        temporary = self.path / f".{name}.tmp"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._open = _Shard(name, fd, temporary, header_room(self.shard_bytes))
        self._unsealed.append(self._open)
        return self._open

    def _seal(self, shard: _Shard) -> None:
        if self._open is shard:
            self._open = None
        try:
            if not shard.lines:
                self._close(shard)
                shard.temporary.unlink(missing_ok=True)
                return
            text = json.dumps({"__metadata__": {"format": "dynsteer-capture"},
                               **shard.header}).encode()
            if len(text) > shard.room - 8:
                raise OSError(f"the header of {shard.name} outgrew its room")
            text += b" " * (shard.room - 8 - len(text))
            write_at(shard.fd, memoryview((len(text)).to_bytes(8, "little") + text), 0)
            os.ftruncate(shard.fd, shard.room + shard.data_bytes)
            for sync in shard.syncs:
                sync.result()
            os.fsync(shard.fd)
            self._close(shard)
            os.replace(shard.temporary, self.path / shard.name)
            with builtins.open(self.path / INDEX, "a", encoding="utf-8") as index:
                index.write("".join(json.dumps(line) + "\n" for line in shard.lines))
                index.flush()
                os.fsync(index.fileno())
        except OSError as e:
            logger.error(
                "dynsteer: capture shard %s could not be written (%s); %d requests dropped",
                self.path / shard.name, e, len(shard.lines))
            self.counters.dropped += len(shard.lines)
            self._close(shard)
            shard.temporary.unlink(missing_ok=True)
            return
        self.counters.requests += len(shard.lines)
        self.counters.bytes += shard.room + shard.data_bytes
        self.counters.shards += 1

    @staticmethod
    def _close(shard: _Shard) -> None:
        for sync in shard.syncs:
            sync.exception()
        shard.syncs.clear()
        if shard.fd >= 0:
            os.close(shard.fd)
            shard.fd = -1


def write_at(fd: int, data: np.ndarray | memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset`` of ``fd``; returns its size."""
    view = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) \
        else data.cast("B")
    size = view.nbytes
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return size


Policy = Literal["block", "drop"]
_SEAL: Any = object()


class ShardThread:
    """A :class:`ShardWriter` fed through a bounded queue by one thread of its own, so a caller
    never waits for the disk unless the queue is full: ``policy="block"`` then waits, ``"drop"``
    drops the item and counts it. Subclasses say what an item is (:meth:`_handle`)."""

    def __init__(self, path: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 queue_size: int = 64, policy: Policy = "block",
                 seal_after_s: float = DEFAULT_SEAL_AFTER_S, tag: str = "",
                 name: str = "dynsteer-capture-sink") -> None:
        if policy not in ("block", "drop"):
            raise ValueError(f"policy: {policy!r} is not 'block' or 'drop'")
        self.policy = policy
        self.writer = ShardWriter(path, shard_bytes, seal_after_s, tag)
        self.path = self.writer.path
        self._queue: queue.Queue[Any] = queue.Queue(queue_size)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def counters(self) -> ShardCounters:
        return self.writer.counters

    def put(self, item: Any, count: bool = True) -> bool:
        """Queue ``item``; False when dropped (queue full under ``drop``; ``count``: counted
        in ``dropped`` here)."""
        try:
            self._queue.put(item, block=self.policy == "block")
        except queue.Full:
            self.counters.dropped += count
            return False
        return True

    def flush(self) -> None:
        """Wait until everything queued is handled, and seal every shard that can be."""
        self._queue.put(_SEAL)
        self._queue.join()

    def close(self) -> None:
        """Seal what can be and stop the thread (requests still unfinished are dropped)."""
        if not self._thread.is_alive():
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        writer = self.writer
        while True:
            try:
                item = self._queue.get(timeout=max(writer.seal_after_s / 4, 0.01))
            except queue.Empty:
                writer.seal()
                continue
            try:
                if item is None:
                    writer.abandon()
                    return
                if item is _SEAL:
                    writer.seal(force=True)
                else:
                    self._handle(item)
                    writer.seal()
            except Exception:
                logger.exception("dynsteer: capture sink %s failed on an item", self.path)
            finally:
                self._queue.task_done()
