"""The site op's persistent buffers, as one named tuple: the one place that lists them.

``dynsteer::steer``'s schema (:mod:`.ops`), its torch and Triton implementations
(:mod:`.kernels`) and the worker that allocates them (:mod:`.state`) all take this tuple, so
adding an input is adding a field here and reading it in both implementations. What each row
and column holds is :mod:`.layout`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SteerBuffers(NamedTuple):
    """The op's persistent buffers, in the op's argument order (after ``x`` and ``h``, before
    ``site``): the one place that lists them. Callers pass ``*buffers``."""

    index: torch.Tensor
    """int32 ``[INDEX_ROWS, T]``: each token's steering, probe and capture row (0: none)."""
    gate_score: torch.Tensor
    """float32 ``[2, T]``: each token's gate and probe score (written at its monitor site)."""
    table: torch.Tensor
    """float32 ``[R, H]``: this site's static tier per steering row."""
    dyn: torch.Tensor
    """float32 ``[R, H]``: this site's gated tier per steering row."""
    flags: torch.Tensor
    """int32 ``[R]``: ``STATIC_FLAG | DYNAMIC_FLAG`` bits of the tiers each row uses."""
    probes: torch.Tensor
    """float32 ``[P, H]``: probe weights."""
    params: torch.Tensor
    """float32 ``[P, 3]``: threshold, sharpness and monitor site of each probe."""
    capture: torch.Tensor
    """float32 ``[K, C + 1, H]``, contiguous: the capture buffer shared by all sites."""
    site_lane: torch.Tensor
    """int32 ``[S]``: each site's capture lane (-1: not captured)."""
    control: torch.Tensor
    """float32 ``[K, CTL_COLS]``: per-request controller state (row 0: none)."""
    proj_dir: torch.Tensor
    """float32 ``[R, D, H]``: this site's projection directions (unit) per steering row."""
    proj_par: torch.Tensor
    """float32 ``[R, D, PROJ_PARAMS]``: each slot's coefficients and target."""
    proj_gram: torch.Tensor
    """float32 ``[R, D, D]``: dot products of each row's directions."""
