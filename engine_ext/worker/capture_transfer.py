"""How collected rows reach the frontend.

A collect's reply travels back through ``collective_rpc``: the engine core's reply socket and,
under a multiprocess executor, the workers' message queue. Both copy and re-frame every byte, so
hundreds of megabytes of rows (a batch of requests capturing every position) would cost far
more there than on the device. When the frontend offers an *inbox* (a private folder, on a
tmpfs where it has one, see :mod:`..frontend.rows_inbox`) that this worker can see — it holds
the token file the frontend wrote — the rows are written into one file there and the reply
carries only offsets; the frontend maps the file. Otherwise (a worker on another host, a full
or missing folder) they travel inline as bytes.

The reply leaves before its file is written: the rows are queued on the device (projected and
cast already, :mod:`.capture_encode`), and a sender thread of this worker copies them off the
device and writes the file, so the engine's next step does not wait for either. The frontend
waits for the file instead (see :mod:`..frontend.rows_inbox` for how a file says it is
written, or why it could not be). The file is written in pieces of :data:`CHUNK` bytes,
:data:`WRITERS` at once, each at its own offset; device pieces go through pinned staging
buffers, one per writer, each reused once its write is done, after a copy on a stream of the
sender's own that waits for the rows to be computed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dynsteer.controller.capture_shards import write_at

from ..frontend.rows_inbox import FAILED, PART, parts

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

CHUNK = 32 << 20
"""Bytes of one write (a larger blob is written in pieces)."""
WRITERS = 4
"""Writes in flight at once."""


Segment = tuple[int, int, int, int]
"""Where bytes of a blob go: (file descriptor, offset in the blob, bytes, offset in the file)."""


class PieceWriter:
    """Writes byte blobs (flat ``uint8``, on the device or the host) into files: each blob in
    pieces of at most :data:`CHUNK` bytes, :data:`WRITERS` at once, device pieces through
    pinned staging buffers after a copy on a stream of its own; every piece is written to the
    parts of files it holds bytes for. One caller at a time (they share the staging
    buffers)."""

    def __init__(self, name: str) -> None:
        self._staging: list[torch.Tensor] = []
        self._writers = ThreadPoolExecutor(WRITERS, thread_name_prefix=name)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def write(self, sources: list[tuple[torch.Tensor, list[Segment]]],
              computed: torch.cuda.Event | None) -> None:
        """Each blob's segments; device blobs once ``computed`` (an event recorded after the
        work that makes them) has passed. Raises the first failed write's error once every
        write has ended."""
        stream = None
        if computed is not None:
            device = next(b.device for b, _ in sources if b.is_cuda)
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            stream = self._streams[device]
            stream.wait_event(computed)
        writes: deque[Future[None]] = deque()
        errors: list[BaseException] = []
        turn = 0
        try:
            for blob, segments in sources:
                flat = blob.reshape(-1)
                segments = sorted(segments, key=lambda s: s[1])
                for start in range(0, flat.numel(), CHUNK):
                    parts = _cut(segments, start, min(start + CHUNK, flat.numel()))
                    if not parts:
                        continue
                    if len(writes) == WRITERS:  # the oldest used this turn's staging buffer
                        _wait(writes.popleft(), errors)
                    piece, ready = self._stage(flat[start:start + CHUNK], turn,
                                               stream if flat.is_cuda else None)
                    writes.append(self._writers.submit(_write_parts, piece, parts, ready))
                    turn = (turn + 1) % WRITERS
        finally:
            while writes:
                _wait(writes.popleft(), errors)
        if errors:
            raise errors[0]

    def _stage(self, piece: torch.Tensor, turn: int, stream: torch.cuda.Stream | None
               ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host piece as it is; a device piece queued on ``stream`` for copying into staging
        buffer ``turn``, with the event after its copy."""
        if stream is None:
            return piece, None
        while len(self._staging) <= turn:
            self._staging.append(torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True))
        staged = self._staging[turn][:piece.numel()]
        with torch.cuda.stream(stream):
            staged.copy_(piece, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return staged, ready


class RowsSender:
    """Sends the byte blobs of one collect to the frontend (inline or through its inbox)."""

    def __init__(self) -> None:
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="dynsteer-rows-send")
        """Writes one reply's file after another (they share the staging buffers)."""
        self._pieces = PieceWriter("dynsteer-rows-write")
        self._seen: dict[tuple[str, str], bool] = {}

    def send(self, blobs: list[torch.Tensor], inbox: dict[str, str] | None
             ) -> tuple[str | None, int, list[dict[str, Any]]]:
        """Per blob (flat ``uint8``), ``{"data": bytes}`` or ``{"part", "offset", "nbytes"}``
        into one of the returned reply's files in the inbox (its first file and how many:
        :func:`..frontend.rows_inbox.parts`), which are written after this returns. A blob is
        whole in one file; the files are about the same size, at most :data:`WRITERS`."""
        total = sum(b.numel() for b in blobs)
        if inbox is not None and total > 0 and self._usable(inbox):
            path = os.path.join(inbox["folder"], f"{uuid.uuid4().hex}.rows")
            paths = parts(path, max(1, min(WRITERS, len(blobs), total // CHUNK)))
            fds: list[int] = []
            try:
                for name in paths:
                    fds.append(os.open(name + PART, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                       0o600))
            except OSError as e:
                logger.warning("dynsteer: rows sent inline; the frontend's inbox %s failed: %s",
                               inbox["folder"], e)
                for fd, name in zip(fds, paths, strict=False):
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(name + PART)
            else:
                placed: list[dict[str, Any]] = []
                sizes = [0] * len(paths)
                for blob in blobs:
                    part = sizes.index(min(sizes))
                    placed.append({"part": part, "offset": sizes[part], "nbytes": blob.numel()})
                    sizes[part] += blob.numel()
                computed = None
                if blobs[0].is_cuda:  # the rows are ready once the work queued so far is done
                    computed = torch.cuda.Event()
                    computed.record(torch.cuda.current_stream(blobs[0].device))
                self._sender.submit(self._write, fds, paths,
                                    [(b, [(fds[p["part"]], 0, b.numel(), p["offset"])])
                                     for b, p in zip(blobs, placed, strict=True)], computed)
                return path, len(paths), placed
        return None, 0, [{"data": b.cpu().numpy().tobytes()} for b in blobs]

    def _usable(self, inbox: dict[str, str]) -> bool:
        """Whether this worker sees the frontend's inbox (the same filesystem)."""
        key = (str(inbox["folder"]), str(inbox["token"]))
        if key not in self._seen:
            try:
                with open(os.path.join(key[0], "token")) as f:
                    self._seen[key] = f.read() == key[1]
            except OSError:
                self._seen[key] = False
        return self._seen[key]

    def _write(self, fds: list[int], paths: list[str],
               blobs: list[tuple[torch.Tensor, list[Segment]]],
               computed: torch.cuda.Event | None) -> None:
        """The sender thread's job: the reply's files, then their renames into place; on
        failure, the reason beside each file not renamed yet (unless the frontend discarded
        it meanwhile)."""
        try:
            try:
                self._pieces.write(blobs, computed)
            finally:
                for fd in fds:
                    os.close(fd)
            for path in paths:
                os.rename(path + PART, path)
        except FileNotFoundError:
            return  # discarded: nobody waits for these rows
        except Exception as e:
            logger.warning("dynsteer: collected rows could not be written to %s: %s", paths[0],
                           e)
            for path in paths:
                if os.path.exists(path + PART):
                    with contextlib.suppress(OSError):
                        with open(path + FAILED + PART, "w") as f:
                            f.write(str(e))
                        os.rename(path + FAILED + PART, path + FAILED)
                    with contextlib.suppress(OSError):
                        os.unlink(path + PART)


def _cut(segments: list[Segment], start: int, end: int) -> list[tuple[int, int, int, int]]:
    """The parts of ``segments`` (sorted by blob offset) within bytes ``start .. end - 1`` of
    their blob, as (fd, offset in the piece, bytes, offset in the file)."""
    parts = []
    for fd, offset, nbytes, at in segments:
        first, stop = max(offset, start), min(offset + nbytes, end)
        if stop > first:
            parts.append((fd, first - start, stop - first, at + first - offset))
    return parts


def _wait(write: Future[None], errors: list[BaseException]) -> None:
    try:
        write.result()
    except Exception as e:  # every write ends before the file is closed
        errors.append(e)


def _write_parts(piece: torch.Tensor, parts: list[tuple[int, int, int, int]],
                 ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()
    data = memoryview(piece.numpy())
    for fd, offset, nbytes, at in parts:
        write_at(fd, data[offset:offset + nbytes], at)
