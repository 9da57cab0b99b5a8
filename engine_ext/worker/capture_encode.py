"""How captured rows leave the device: projected and cast there, so only the bytes asked for
are copied out.

``project`` (``{"k", "seed"}``) multiplies the rows by the seeded random matrix of
:func:`dynsteer.controller.activations.projection_matrix` (the client can make the same
matrix); ``dtype`` casts them: ``float32``, ``float16``, ``bfloat16`` (sent as its 16 bits) or
``int8`` with one float32 scale per row (``max |row| / 127``). The bytes stay on the device
until :mod:`.capture_transfer` sends them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from dynsteer.controller.activations import projection_matrix

_CASTS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=8)
def _matrix(seed: int, hidden: int, k: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(projection_matrix(seed, hidden, k)).to(device)


def encode(rows: torch.Tensor, dtype: str, project: dict[str, Any] | None
           ) -> tuple[torch.Tensor, bytes, int]:
    """``rows`` (float32 ``[sites, positions, hidden]``) as (their little-endian bytes of
    ``dtype``, flat ``uint8`` on the rows' device; the int8 rows' float32 scales or ``b""``;
    the width of a row)."""
    if project is not None:
        rows = rows @ _matrix(int(project["seed"]), rows.shape[-1], int(project["k"]),
                              rows.device)
    scales = b""
    if dtype == "int8":
        scale = rows.abs().amax(dim=-1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
        scales = np.ascontiguousarray(scale.squeeze(-1).cpu().numpy(), "<f4").tobytes()
    else:
        out = rows.to(_CASTS[dtype])
    return out.contiguous().view(-1).view(torch.uint8), scales, int(rows.shape[-1])
