"""Host-written device buffers of the step path, uploaded together in one copy.

A step that admits or finishes requests rewrites several small device buffers from the host: the
batch's slots and the per-slot table the device fill reads (:mod:`.token_rows`), and the gate
statistics' op buffer (:mod:`.gate_stats`). Each upload is a CUDA call of ~10-14 µs of host time
in a serving engine, and these steps set the inter-token latency's tail. Here the buffers are
regions (views) of one device buffer, written on the host into one plain numpy mirror of it, and
sent by one copy before the first replay that reads any of them.

The mirror holds every region's current contents, so a send may copy regions nobody changed
along with those that changed: it copies the span from the first region to the end of the
last changed one (regions are laid out most frequently changed first), through two pinned
staging buffers in turn (:class:`Staged`, which the token index's own upload uses too).

A region the device rewrites after reading it (the op buffer: its replay resets the head)
must have its mirror reset the same way by its owner once a send carried it, or a later send
would repeat it (see :meth:`.GateStats.flush`). On the host (CPU tensors) the mirror *is* the
device buffer and sending does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from . import cuda_events

ALIGN = 256
"""Each region starts at a multiple of this many bytes (Triton's loads like aligned bases)."""

Layout = Mapping[str, tuple[tuple[int, ...], type[np.generic]]]
"""Region name -> (shape, numpy dtype), in the buffer's order."""


class Staged:
    """A device tensor rewritten from the host through two pinned staging buffers in turn:
    each upload is one contiguous non-blocking copy, of the whole tensor or of a prefix along
    its first dimension given in ``spans`` (views made once: slicing a tensor costs host
    time), and a staging buffer is reused only once the copy that last read it is done (on
    the host, the tensor is written directly)."""

    def __init__(self, target: torch.Tensor, spans: Iterable[int] = ()) -> None:
        self.target = target
        self._on_host = target.device.type == "cpu"
        if not self._on_host:
            pinned = [torch.zeros_like(target, device="cpu").pin_memory() for _ in range(2)]
            host = [p.numpy() for p in pinned]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._spans = {None: (target, pinned, host)} | {
                end: (target[:end], [p[:end] for p in pinned], [h[:end] for h in host])
                for end in spans}
            """Per prefix end (``None``: the whole tensor), its device view and the two
            staging buffers' pinned and numpy views."""
        self.turn = 0
        """The staging buffer :meth:`stage` hands out next."""

    def stage(self, end: int | None = None) -> np.ndarray:
        """The buffer to write the tensor's new contents into (all of it, or its prefix
        ``end`` of ``spans``, is copied)."""
        if self._on_host:
            return self.target.numpy()
        self._events[self.turn].synchronize()
        return self._spans[end][2][self.turn]

    def send(self, end: int | None = None) -> None:
        """Copy the staged contents (the prefix ``end`` of ``spans``: the same as
        :meth:`stage` was given) to the device."""
        if not self._on_host:
            target, pinned, _ = self._spans[end]
            target.copy_(pinned[self.turn], non_blocking=True)
            cuda_events.record(self._events[self.turn], self.target.device.index)
            self.turn ^= 1


class StepUpload:
    """Regions of one device buffer, written on the host (:meth:`host`), uploaded together
    by :meth:`send`; the device views (:meth:`region`) never move, so CUDA graphs read them."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        starts, ends, size = {}, [], 0
        for name, (shape, dtype) in layout.items():
            starts[name] = size
            size += int(np.prod(shape)) * np.dtype(dtype).itemsize
            ends.append(size)
            size = -(-size // ALIGN) * ALIGN
        self._device = torch.zeros(size, dtype=torch.uint8, device=device)
        self._on_host = device.type == "cpu"
        mirror = self._device.numpy() if self._on_host else np.zeros(size, dtype=np.uint8)
        self._regions, self._host, self._end = {}, {}, {}
        for (name, (shape, dtype)), end in zip(layout.items(), ends, strict=True):
            start = starts[name]
            torch_dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
            self._regions[name] = self._device[start:end].view(torch_dtype).view(shape)
            self._host[name] = mirror[start:end].view(dtype).reshape(shape)
            self._end[name] = end
        self._dirty = 0
        """Bytes [0, dirty) hold a change the device has not been sent."""
        if not self._on_host:
            self._staged = Staged(self._device, set(ends))
            self._mirror_spans = {end: mirror[:end] for end in set(ends)}

    def region(self, name: str) -> torch.Tensor:
        """The region's device tensor (a fixed view: captured graphs may read it)."""
        return self._regions[name]

    def host(self, name: str) -> np.ndarray:
        """The region's host mirror: write the new contents here, then :meth:`changed`."""
        return self._host[name]

    def changed(self, name: str) -> None:
        """The region's mirror was written: the next :meth:`send` carries it."""
        self._dirty = max(self._dirty, self._end[name])

    def send(self) -> None:
        """Upload what changed (one copy; nothing when nothing did), before a replay that
        reads a region."""
        if not self._dirty or self._on_host:
            self._dirty = 0
            return
        end, self._dirty = self._dirty, 0
        np.copyto(self._staged.stage(end), self._mirror_spans[end])
        self._staged.send(end)
