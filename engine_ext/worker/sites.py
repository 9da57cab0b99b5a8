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
from .ops import SteerBuffers


@dataclass(frozen=True)
class SiteBuffers:
    """What one site's op reads: its position and the worker's steering buffers (views)."""

    position: int
    """Position of the site in forward order (what probe params store as the monitor site)."""
    buffers: SteerBuffers
    """The op's buffers; ``table``, ``dyn`` and ``flags`` are this site's."""


class SiteOp(nn.Module):
    """The steering op of one site; buffers are shared with the worker's steering state."""

    def __init__(self, site: SiteBuffers) -> None:
        super().__init__()
        self.position = site.position
        for name, buffer in site.buffers._asdict().items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Steer ``x``; the stream the monitor reads is ``x + h`` (``x`` alone when h is None).
        The per-token buffers go in whole: the op reads their first ``x.shape[0]`` columns."""
        buffers = [getattr(self, name) for name in SteerBuffers._fields]
        return torch.ops.dynsteer.steer(x, h, *buffers, self.position)


def install_sites(model: nn.Module, buffers: dict[Site, SiteBuffers]) -> list[Site]:
    """Put one op per configured site into the model (see :mod:`..compat.model`); returns
    the sites installed here (a pipeline stage installs those on its own layers)."""
    return wrap_sites(model, {site: SiteOp(b) for site, b in buffers.items()})  # type: ignore[return-value]
