"""Steering rows: the per-site tables the in-graph op reads.

One tensor ``table[S, R, H]`` (fp32) holds, for every site ``s``, the rows ``r``; row 0 is all
zeros and means "not steered". A row is the *sum* of everything that steers one kind of token
(one request config in one phase, global steering included), so the kernel does one gather-add
per site whatever the number of entries. Rows are deduplicated by content and refcounted:
requests with the same config share a row.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from dynsteer.engine_ext.options import Site

logger = logging.getLogger(__name__)

Contents = dict[Site, np.ndarray]
"""What one row adds at each site (float32 vectors of hidden size); absent sites add zero."""


def add_contents(a: Contents, b: Contents) -> Contents:
    """Sum of two row contents."""
    out = {site: vec.copy() for site, vec in a.items()}
    for site, vec in b.items():
        out[site] = out[site] + vec if site in out else vec.copy()
    return out


def _digest(contents: Contents) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for site in sorted(contents):
        h.update(repr(site).encode())
        h.update(np.ascontiguousarray(contents[site], dtype=np.float32).tobytes())
    return h.digest()


class RowTable:
    """Allocates rows of the per-site steering tables and writes their contents."""

    def __init__(
        self, sites: tuple[Site, ...], hidden_size: int, max_rows: int, device: torch.device
    ) -> None:
        self.sites = sites
        self.hidden_size = hidden_size
        self.max_rows = max_rows
        self._site_index = {site: i for i, site in enumerate(sites)}
        self.table = torch.zeros(
            len(sites), max_rows + 1, hidden_size, dtype=torch.float32, device=device
        )
        self._row_of_key: dict[bytes, int] = {}
        self._key_of_row: dict[int, bytes] = {}
        self._refs = [0] * (max_rows + 1)
        self._free = list(range(max_rows, 0, -1))
        self.rejected = 0
        """Acquisitions refused because every row was in use."""

    def site_table(self, site: Site) -> torch.Tensor:
        """The ``[R, H]`` view one site's op reads."""
        return self.table[self._site_index[site]]

    @property
    def in_use(self) -> int:
        """Rows currently holding steering (row 0 excluded)."""
        return self.max_rows - len(self._free)

    def acquire(self, contents: Contents) -> int | None:
        """A row holding ``contents`` (0 when empty), or None when the table is full."""
        contents = {s: v for s, v in contents.items() if s in self._site_index and v.any()}
        if not contents:
            return 0
        key = _digest(contents)
        row = self._row_of_key.get(key)
        if row is None:
            if not self._free:
                self.rejected += 1
                return None
            row = self._free.pop()
            self._write(row, contents)
            self._row_of_key[key] = row
            self._key_of_row[row] = key
        self._refs[row] += 1
        return row

    def release(self, row: int) -> None:
        """Drop one reference; the row is free for new contents when none remain."""
        if row == 0:
            return
        self._refs[row] -= 1
        if self._refs[row] == 0:
            del self._row_of_key[self._key_of_row.pop(row)]
            self._free.append(row)

    def _write(self, row: int, contents: Contents) -> None:
        host = torch.zeros(len(self.sites), self.hidden_size, dtype=torch.float32)
        for site, vec in contents.items():
            host[self._site_index[site]] = torch.from_numpy(np.asarray(vec, dtype=np.float32))
        # Issued on the current stream: ordered after every forward that read the old contents.
        self.table[:, row].copy_(host.to(self.table.device))
