"""The steering op of each configured site, as an ``nn.Module`` over the worker's buffers.

Where a site sits in a vLLM decoder layer, and how the module is wrapped in, is the adapter's
business (:mod:`dynsteer.engine_ext.compat.model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynsteer.controller.contract import Site

from ..compat.model import wrap_sites


@dataclass(frozen=True)
class SiteBuffers:
    """The persistent buffers one site's op reads (views into the worker's steering state)."""

    index: int
    """Position of the site in forward order (what probe params store as the monitor site)."""
    rows: torch.Tensor
    probe_rows: torch.Tensor
    table: torch.Tensor
    dyn: torch.Tensor
    flags: torch.Tensor
    probes: torch.Tensor
    params: torch.Tensor
    gate: torch.Tensor
    score: torch.Tensor
    capture_rows: torch.Tensor
    """Per-token capture row (0: not captured)."""
    capture: torch.Tensor
    """The capture buffer ``[K, C + 1, H]`` shared by all sites."""
    site_lane: torch.Tensor
    """Per site: its capture lane, -1 when not captured."""


class SiteOp(nn.Module):
    """The steering op of one site; buffers are shared with the worker's steering state."""

    def __init__(self, buffers: SiteBuffers) -> None:
        super().__init__()
        self.site_index = buffers.index
        for name in ("rows", "probe_rows", "table", "dyn", "flags", "probes", "params", "gate",
                     "score", "capture_rows", "capture", "site_lane"):
            self.register_buffer(name, getattr(buffers, name), persistent=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Steer ``x``; the stream the monitor reads is ``x + h`` (``x`` alone when h is None)."""
        n = x.shape[0]
        return torch.ops.dynsteer.steer(
            x, h, self.rows[:n], self.probe_rows[:n], self.table, self.dyn, self.flags,
            self.probes, self.params, self.gate, self.score, self.capture_rows[:n], self.capture,
            self.site_lane, self.site_index,
        )


def install_sites(model: nn.Module, buffers: dict[Site, SiteBuffers]) -> list[Site]:
    """Put one op per configured site into the model (see :mod:`..compat.model`); returns
    the sites installed here (a pipeline stage installs those on its own layers)."""
    return wrap_sites(model, {site: SiteOp(b) for site, b in buffers.items()})  # type: ignore[return-value]
