"""How collected rows reach the frontend.

A collect's reply travels back through ``collective_rpc``: the engine core's reply socket and,
under a multiprocess executor, the workers' message queue. Both copy and re-frame every byte, so
hundreds of megabytes of rows (a batch of requests capturing every position) would cost far
more there than on the device. When the frontend offers an *inbox* (a private folder, on a
tmpfs where it has one, see :mod:`..frontend.rows_inbox`) that this worker can see — it holds
the token file the frontend wrote — the rows are written into one file there and the reply
carries only offsets; the frontend maps the file. Otherwise (a worker on another host, a full
or missing folder) they travel inline as bytes.

Device rows are copied out through one pinned staging buffer: the copies of several requests
are queued on the device, then written with one ``os.write`` per chunk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any

import torch

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

CHUNK = 64 << 20
"""Bytes of the pinned staging buffer (device rows are written out in pieces of this size)."""


class RowsSender:
    """Sends the byte blobs of one collect to the frontend (inline or through its inbox)."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None
        self._seen: dict[tuple[str, str], bool] = {}

    def send(self, blobs: list[torch.Tensor], inbox: dict[str, str] | None
             ) -> tuple[str | None, list[dict[str, Any]]]:
        """Per blob (flat ``uint8``), ``{"data": bytes}`` or ``{"offset", "nbytes"}`` into the
        returned file of the inbox."""
        if inbox is not None and sum(b.numel() for b in blobs) > 0 and self._usable(inbox):
            path = os.path.join(inbox["folder"], f"{uuid.uuid4().hex}.rows")
            try:
                return path, self._write(path, blobs)
            except OSError as e:
                logger.warning("dynsteer: rows sent inline; the frontend's inbox %s failed: %s",
                               inbox["folder"], e)
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return None, [{"data": b.cpu().numpy().tobytes()} for b in blobs]

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

    def _write(self, path: str, blobs: list[torch.Tensor]) -> list[dict[str, Any]]:
        placed: list[dict[str, Any]] = []
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            offset = 0
            for blob in blobs:
                placed.append({"offset": offset, "nbytes": blob.numel()})
                offset += blob.numel()
            if blobs[0].is_cuda:
                self._write_device(fd, blobs)
            else:
                for blob in blobs:
                    _write_all(fd, memoryview(blob.contiguous().numpy()))
        finally:
            os.close(fd)
        return placed

    def _write_device(self, fd: int, blobs: list[torch.Tensor]) -> None:
        """Queue device-to-host copies into the staging buffer; write it out whenever full."""
        if self._staging is None:
            self._staging = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
        staging, view = self._staging, memoryview(self._staging.numpy())
        filled = 0
        for blob in blobs:
            flat, done = blob.reshape(-1), 0
            while done < flat.numel():
                take = min(CHUNK - filled, flat.numel() - done)
                staging[filled:filled + take].copy_(flat[done:done + take], non_blocking=True)
                filled, done = filled + take, done + take
                if filled == CHUNK:
                    torch.cuda.current_stream(blob.device).synchronize()
                    _write_all(fd, view)
                    filled = 0
        if filled:
            torch.cuda.current_stream(blobs[-1].device).synchronize()
            _write_all(fd, view[:filled])


def _write_all(fd: int, data: memoryview) -> None:
    data = data.cast("B")
    while data.nbytes:
        data = data[os.write(fd, data):]

