"""Keep the steering op's small per-step buffers resident in the GPU's L2 cache (tried in the
engine in session 14 as an engine option, ``d4174db``: +0.15-0.26% of a decode step at batch 1,
-0.25-0.31% at batch 32, so not shipped; ``site_cost.py --l2-window`` uses it).

Every steering site reads the token's index entry and gate before anything else (a dependent
load: which row to add, if any). In a decoder layer the site sits between GEMMs that stream
megabytes of weights through L2, so by the next site those few bytes have been evicted and the
read is an HBM round trip on the kernel's critical path, at every site of every step, steered or
not. An L2 *access-policy window* marks an address range as persisting: lines in it are kept
in a set-aside part of L2 that streaming traffic does not evict.

The window is a property of the stream, so it is set on the streams the forward runs and is
captured on. That stream capture carries it into the graph's kernel nodes is inferred, not
shown: the engine's step changed consistently with it (both ways, by batch), and the DOT dump
meant to show the nodes' attributes (``site_cost.py --l2-window``) wrote no file.
CUDA's driver API is called through :mod:`ctypes`: PyTorch exposes neither the persisting-L2
limit nor stream attributes.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_ATTR_MAX_PERSISTING_L2_CACHE_SIZE = 108
_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_STREAM_ATTR_ACCESS_POLICY_WINDOW = 1
_ACCESS_NORMAL, _ACCESS_STREAMING, _ACCESS_PERSISTING = 0, 1, 2


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hit_ratio", ctypes.c_float), ("hit_prop", ctypes.c_int),
                ("miss_prop", ctypes.c_int)]


class _StreamAttr(ctypes.Union):
    """``CUstreamAttrValue``: a 64-byte union, of which the window is one member."""

    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def _ordinal(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _device_attribute(attribute: int, device: torch.device) -> int:
    value = ctypes.c_int()
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(value), attribute, _ordinal(device)),
           "cuDeviceGetAttribute")
    return value.value


def persisting_l2_bytes(device: torch.device) -> int:
    """The most L2 the device can set aside for persisting lines (0: not supported)."""
    return _device_attribute(_ATTR_MAX_PERSISTING_L2_CACHE_SIZE, device)


def reserve(device: torch.device, nbytes: int) -> int:
    """Set aside ``nbytes`` of L2 (capped at the device's maximum) for persisting lines in the
    current context; returns the bytes set aside."""
    nbytes = min(nbytes, persisting_l2_bytes(device))
    torch.cuda.set_device(_ordinal(device))
    _check(_driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)),
           "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)")
    return nbytes


def nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def set_window(stream: torch.cuda.Stream, buffer: torch.Tensor) -> None:
    """Mark ``buffer``'s bytes persisting for kernels launched (or captured) on ``stream``."""
    size = nbytes(buffer)
    limit = _device_attribute(_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE, buffer.device)
    if size > limit:
        raise ValueError(f"an L2 window of {size} bytes exceeds the device's {limit}")
    attr = _StreamAttr()
    attr.window = _Window(buffer.data_ptr(), size, 1.0, _ACCESS_PERSISTING, _ACCESS_STREAMING)
    _check(_driver().cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                          _STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(attr)),
           "cuStreamSetAttribute(ACCESS_POLICY_WINDOW)")
