"""The engine's own capture sinks: rows written to disk by the worker while requests run.

A sink named in the engine option ``dynsteer.capture_sinks`` is a folder of safetensors shards
(:mod:`dynsteer.controller.capture_shards`, read back with ``dynsteer.capture.open``) that TP
rank 0 of each pipeline stage writes itself. A request whose capture names it never sends its
rows to the frontend: :mod:`.capture_buffers` hands the sink each stretch of rows once it is
computed (the prompt's after prefill, then every :data:`FLUSH_ROWS` generated positions, the
rest when the request finishes), as bytes queued on the device behind an event. This sink's
thread copies them off on a stream of its own and writes them into the request's blocks, so the
disk keeps pace with generation instead of taking the whole batch's rows at its end.

Jobs wait in a bounded queue, and the device bytes they hold in a budget of
:data:`PENDING_BYTES`; when either is full, ``policy="block"`` makes the step wait and
``"drop"`` drops the stretch (its request's index line then says ``dropped``).
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynsteer.controller.capture_shards import Reservation, ShardThread
from dynsteer.controller.capture_store import sink_settings

from .capture_transfer import PieceWriter, Segment

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

FLUSH_ROWS = 16
"""Generated positions a running request gathers before they are written."""
PENDING_BYTES = 2 << 30
"""Device bytes queued for writing at most (a full budget counts as a full queue)."""


@dataclass
class Stretch:
    """Rows of one request for its sink: the tensors to reserve (first stretch), the bytes to
    write into them, and, with the last stretch, its index line (``tensor`` fields name tensor
    keys; the sink puts in their names)."""

    request_id: str
    tensors: dict[str, tuple[str, np.dtype, tuple[int, ...]]]
    pieces: list[tuple[str, torch.Tensor, int, int, int]] = field(default_factory=list)
    """(tensor key, a flat ``uint8`` blob that stretches of one step share, offset in it,
    bytes, offset in the tensor)."""
    line: dict[str, Any] | None = None
    final: bool = False


@dataclass
class _Job:
    stretches: list[Stretch]
    computed: torch.cuda.Event | None
    nbytes: int


class EngineSink(ShardThread):
    """One configured sink on a worker that writes (``tag`` tells pipeline stages' shards
    apart)."""

    def __init__(self, name: str, value: str, tag: str = "") -> None:
        folder, settings = sink_settings(name, value)
        settings.setdefault("queue_size", 1024)
        super().__init__(folder, tag=tag, name=f"dynsteer-sink-{name}", **settings)
        self.name = name
        self._pieces = PieceWriter(f"dynsteer-sink-{name}-write")
        self._reserved: dict[str, Reservation] = {}
        self._lost: set[str] = set()
        self._pending = 0
        self._room = threading.Condition()

    def send(self, stretches: list[Stretch]) -> bool:
        """Queue stretches whose bytes are being computed on the current stream; False when
        dropped (their requests' lines will say so)."""
        nbytes = sum(size for s in stretches for _, _, _, size, _ in s.pieces)
        computed = None
        if any(piece[1].is_cuda for s in stretches for piece in s.pieces):
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream())
        with self._room:
            while self._pending and self._pending + nbytes > PENDING_BYTES:
                if self.policy == "drop":
                    self._lose(stretches)
                    return False
                self._room.wait()
            self._pending += nbytes
        if self.put(_Job(stretches, computed, nbytes), count=False):
            return True
        self._release(nbytes)
        self._lose(stretches)
        return False

    def _lose(self, stretches: list[Stretch]) -> None:
        """Dropped stretches: their requests' lines say so (a last stretch still ends them)."""
        for stretch in stretches:
            self._lost.add(stretch.request_id)
            if stretch.final:  # blocks for room: the request's end is never lost
                self._queue.put(_Job([Stretch(stretch.request_id, stretch.tensors,
                                              line=stretch.line, final=True)], None, 0))

    def _release(self, nbytes: int) -> None:
        with self._room:
            self._pending -= nbytes
            self._room.notify_all()

    def _handle(self, job: _Job) -> None:
        try:
            sources: dict[int, tuple[torch.Tensor, list[Segment]]] = {}
            for stretch in job.stretches:
                reservation = self._reserved.get(stretch.request_id)
                if reservation is None:
                    reservation = self.writer.reserve(stretch.tensors)
                    self._reserved[stretch.request_id] = reservation
                for key, blob, offset, size, into in stretch.pieces:
                    sources.setdefault(id(blob), (blob, []))[1].append(
                        (reservation.fd, offset, size, reservation.offsets[key] + into))
            try:
                if sources:
                    self._pieces.write(list(sources.values()), job.computed)
            except OSError as e:
                logger.error("dynsteer: capture sink %s could not write (%s)", self.path, e)
                self._lost.update(s.request_id for s in job.stretches)
            for stretch in job.stretches:
                reservation = self._reserved[stretch.request_id]
                self.writer.wrote(reservation, sum(p[3] for p in stretch.pieces))
                if stretch.final:
                    del self._reserved[stretch.request_id]
                    self._finish(reservation, stretch)
        finally:
            job.stretches.clear()
            self._release(job.nbytes)

    def _finish(self, reservation: Reservation, stretch: Stretch) -> None:
        line = stretch.line
        if line is None or stretch.request_id in self._lost:
            self._lost.discard(stretch.request_id)
            self.counters.dropped += 1
            self.writer.finish(reservation, None)
            return
        names = reservation.names
        if line.get("positions"):
            line["positions"]["tensor"] = names[line["positions"]["tensor"]]
        for entry in line["sites"].values():
            entry["tensor"] = names[entry["tensor"]]
            if "scales" in entry:
                entry["scales"] = names[entry["scales"]]
        self.writer.finish(reservation, line)


def open_sinks(configured: dict[str, str], stage: int, stages: int) -> dict[str, EngineSink]:
    """The engine's sinks on a worker that writes them (pipeline stage ``stage`` of
    ``stages``)."""
    tag = f"stage{stage}-" if stages > 1 else ""
    sinks = {name: EngineSink(name, value, tag) for name, value in configured.items()}
    for sink in sinks.values():
        atexit.register(sink.close)  # an engine that stops seals what it can
    return sinks
