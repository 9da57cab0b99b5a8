"""The per-site index of the fused sites (engine option ``fused_index="per_site"``).

A persistent ``int32[max_tokens, S]`` buffer: each token's steering row at each site where
that row steers, else 0 (see :func:`.ops.fill_site_rows`). A fused site reads its column
instead of the token index, so a request steered at one layer loads no row at the other
sites. It is recomputed on the device from the token index and the rows' flags only when the
index was republished or a row rewritten since the last step (a decode step whose batch did
not change costs nothing). On CUDA the fill is one replay of a CUDA graph captured here, so
its kernel costs no launch work on the host.
"""

from __future__ import annotations

import torch

from .ops import fill_site_rows


class SiteRows:
    """Owns the per-site index and refreshes it from the token index and the rows' flags."""

    def __init__(self, index: torch.Tensor, flags: torch.Tensor) -> None:
        self.buffer = torch.zeros(index.shape[1], flags.shape[0], dtype=torch.int32,
                                  device=index.device)
        self._index, self._flags = index, flags
        self._seen = (0, 0)
        self._graph = self._capture() if index.is_cuda else None

    def column(self, site: int) -> torch.Tensor:
        """What the fused op of site ``site`` (its position) reads: one row per token."""
        return self.buffer[:, site]

    def refresh(self, publishes: int, row_writes: int) -> None:
        """Recompute the buffer if ``publishes`` (of the token index) or ``row_writes`` (of
        the row table) moved since the last call; queued on the current stream, before the
        step's forward."""
        if (publishes, row_writes) == self._seen:
            return
        self._seen = (publishes, row_writes)
        if self._graph is not None:
            self._graph.replay()
        else:
            fill_site_rows(self._index, self._flags, self.buffer)

    def _capture(self) -> torch.cuda.CUDAGraph:
        fill_site_rows(self._index, self._flags, self.buffer)  # compiled outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fill_site_rows(self._index, self._flags, self.buffer)
        return graph
