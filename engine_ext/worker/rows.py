"""Steering rows and probe rows: the tables the in-graph op reads.

``table[S, R, H]`` / ``dyn[S, R, H]`` (fp32) hold, for every site ``s``, the static and the
gated (dynamic) part of each row ``r``; ``flags[S, R]`` says which part a row uses at a site, so
the kernel never reads an unused row. Row 0 is all zeros and means "not steered". A row is the
*sum* of everything that steers one kind of token (one request config in one phase, global
steering included), so the kernel does one gather per site whatever the number of entries.

A row may also hold up to ``D`` (engine option ``max_projections``) *projections* per site: the
ablate / clamp entries, each a unit direction ``proj_dir[S, R, D]``, its coefficients and target
``proj_par[S, R, D]`` (static, gated, value) and the Gram matrix of the row's directions
``proj_gram[S, R]``, which lets the kernel apply them one after the other from dot products with
the incoming stream alone (:mod:`.ops`). The flag ``PROJECT_FLAG`` marks rows that have any.

``probes[P, H]`` / ``params[P, 3]`` (threshold, sharpness, monitor site index) hold the probes of
gated requests; probe row 0 means "no monitor". Both tables deduplicate identical contents and
refcount them: requests with the same config share a row.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dynsteer.controller.contract import Site

from .layout import (
    DYNAMIC_FLAG,
    PARAM_SHARPNESS,
    PARAM_SITE,
    PARAM_THRESHOLD,
    PARAMS,
    PROJ_GATED,
    PROJ_NORM,
    PROJ_PARAMS,
    PROJ_STATIC,
    PROJ_VALUE,
    PROJECT_FLAG,
    ROW_MASK,
    STATIC_FLAG,
    row_entry,
    site_bit,
)
from .resolve import Contents, ProbeRow, Projection, Projections


def _nonzero(contents: Contents, sites: dict[Site, int]) -> Contents:
    return {s: v for s, v in contents.items() if s in sites and v.any()}


def _digest(*parts: object) -> bytes:
    """Content key of a row: contents dicts and arrays by bytes, anything else by repr."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, dict):
            for site in sorted(part):
                h.update(repr(site).encode())
                value = part[site]
                for item in value if isinstance(value, tuple) else (value,):
                    if isinstance(item, Projection):
                        h.update(repr((item.static, item.gated, item.value)).encode())
                        item = item.direction
                    h.update(np.ascontiguousarray(item, dtype=np.float32).tobytes())
        elif isinstance(part, np.ndarray):
            h.update(np.ascontiguousarray(part, dtype=np.float32).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.digest()


ALIASES = 256
"""Caller keys remembered per slot (and for empty contents); an older one is forgotten, which
only means its next request builds and hashes its contents again. Many specs may share one
row (e.g. distinct probes gating the same vector: two keys each, one per phase)."""


@dataclass
class _Slots:
    """Refcounted slots 1..capacity keyed by content (slot 0 is the shared zero).

    A slot whose last reference is given back keeps its key and contents ("idle"): a later
    request with the same key takes it again without rewriting the table, which matters for
    serving, where a config's requests come and go. Idle slots are reused for new keys least
    recently used first, once no never-used slot is left.

    Besides its content key a slot may have *aliases*: callers' keys that determine the same
    contents (:meth:`alias`), so a request whose key was seen takes the slot without building
    its contents, while requests with different keys and equal contents still share one slot.
    """

    capacity: int
    rejected: int = 0
    _by_key: dict[bytes, int] = field(default_factory=dict)
    _keys_of: dict[int, list[bytes]] = field(default_factory=dict)
    """Content key first, then aliases."""
    _refs: dict[int, int] = field(default_factory=dict)
    _free: list[int] = field(default_factory=list)
    _idle: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self._free = list(range(self.capacity, 0, -1))

    @property
    def in_use(self) -> int:
        """Slots referenced by at least one request."""
        return self.capacity - len(self._free) - len(self._idle)

    def take(self, key: bytes) -> tuple[int | None, bool]:
        """(slot, is_new); slot None when full. ``is_new``: the caller must write it."""
        slot = self.reuse(key)
        if slot is not None:
            return slot, False
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            slot, _ = self._idle.popitem(last=False)
            for old in self._keys_of.pop(slot):
                del self._by_key[old]
        else:
            self.rejected += 1
            return None, False
        self._by_key[key] = slot
        self._keys_of[slot] = [key]
        self._refs[slot] = 1
        return slot, True

    def reuse(self, key: bytes) -> int | None:
        """The slot already holding ``key`` (in use or idle) with one more reference, or None
        (0 for an alias of empty contents)."""
        slot = self._by_key.get(key)
        if slot:
            self._idle.pop(slot, None)
            self._refs[slot] += 1
        return slot

    def alias(self, key: bytes, slot: int) -> None:
        """Let ``key`` name ``slot`` too (slot 0: empty contents, needing no slot)."""
        if key in self._by_key:
            return
        keys = self._keys_of.setdefault(slot, [])
        if len(keys) > ALIASES:  # the content key (first) stays
            del self._by_key[keys.pop(1 if slot else 0)]
        keys.append(key)
        self._by_key[key] = slot

    def give_back(self, slot: int) -> None:
        if slot == 0:
            return
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None


class RowTable:
    """Allocates steering rows and writes their static and gated contents per site."""

    def __init__(
        self, sites: tuple[Site, ...], hidden_size: int, max_rows: int, device: torch.device,
        max_projections: int = 0, site_groups: bool = True,
    ) -> None:
        """``site_groups=False`` keeps plain rows as entries (no group bits): the fused
        sites' form without groups (:func:`.ops.steer_add` with ``site_bit`` 0), a baseline
        for the groups (``benchmarks/overhead.py --variant``)."""
        if max_rows > ROW_MASK:
            raise ValueError(f"max_rows={max_rows} exceeds the index's {ROW_MASK}")
        self.sites = sites
        self.hidden_size = hidden_size
        self.max_rows = max_rows
        self.max_projections = max_projections
        self._site_index = {site: i for i, site in enumerate(sites)}
        shape = (len(sites), max_rows + 1, hidden_size)
        self.table = torch.zeros(shape, dtype=torch.float32, device=device)
        self.dyn = torch.zeros(shape, dtype=torch.float32, device=device)
        self.flags = torch.zeros(len(sites), max_rows + 1, dtype=torch.int32, device=device)
        d = max_projections
        self.proj_dir = torch.zeros(*shape[:2], d, hidden_size, dtype=torch.float32,
                                    device=device)
        self.proj_par = torch.zeros(*shape[:2], d, PROJ_PARAMS, dtype=torch.float32,
                                    device=device)
        self.proj_gram = torch.zeros(*shape[:2], d, d, dtype=torch.float32, device=device)
        self._slots = _Slots(max_rows)
        self._written: dict[int, frozenset[int]] = {}
        """Per row: the site indices its current contents occupy (the rest are zero)."""
        self.site_groups = site_groups
        self.entries = np.arange(max_rows + 1, dtype=np.int32)
        """Per row: its token-index entry, the row and the bits of the site groups its
        contents occupy (:func:`.layout.row_entry`); row 0's is 0."""
        self.entries_version = 0
        """Counts the changes of :attr:`entries` (the device fill's slot table follows)."""

    def site_index(self, site: Site) -> int:
        return self._site_index[site]

    def site_bit(self, index: int) -> int:
        """The group bit the fused site at ``index`` tests in a token's entry (0: no site
        groups, entries are plain rows); the counterpart of :attr:`entries`."""
        return site_bit(index, len(self.sites)) if self.site_groups else 0

    @property
    def in_use(self) -> int:
        """Rows currently holding steering (row 0 excluded)."""
        return self._slots.in_use

    @property
    def rejected(self) -> int:
        """Acquisitions refused because every row was in use."""
        return self._slots.rejected

    def acquire(self, static: Contents, dynamic: Contents | None = None,
                key: bytes | None = None, projections: Projections | None = None
                ) -> int | None:
        """A row holding ``static`` + gated ``dynamic`` + ``projections`` (0 when all are
        empty); None when full. A ValueError when a site has more projections than the
        table's ``max_projections`` slots.

        Rows are shared by content (``key`` defaults to a digest of it) or by a caller's key
        that determines the content (see :meth:`acquire_keyed`)."""
        static = _nonzero(static, self._site_index)
        dynamic = _nonzero(dynamic or {}, self._site_index)
        projections = {s: p for s, p in (projections or {}).items()
                       if s in self._site_index and p}
        for site, items in projections.items():
            if len(items) > self.max_projections:
                raise ValueError(f"{len(items)} ablate / clamp entries at {site}, more than "
                                 f"max_projections={self.max_projections}")
        if not static and not dynamic and not projections:
            return 0
        row, fresh = self._slots.take(key or _digest(static, "dyn", dynamic, "proj",
                                                     projections))
        if fresh:
            self._write(row, static, dynamic, projections)  # type: ignore[arg-type]
        return row

    def acquire_keyed(self, key: bytes,
                      make: Callable[[], tuple[Contents, Contents, Projections]]
                      ) -> int | None:
        """:meth:`acquire` for contents that ``key`` determines: a request whose key was seen
        takes that row without building or hashing its contents (``make`` runs otherwise, and
        the row is shared with any other key of equal contents)."""
        row = self._slots.reuse(b"k" + key)
        if row is not None:
            return row
        static, dynamic, projections = make()
        row = self.acquire(static, dynamic, projections=projections)
        if row is not None:
            self._slots.alias(b"k" + key, row)
        return row

    def release(self, row: int) -> None:
        """Drop one reference; the row is free for new contents when none remain."""
        self._slots.give_back(row)

    def _write(self, row: int, static: Contents, dynamic: Contents,
               projections: Projections) -> None:
        """Write the row's new contents and zero what its old contents left at other sites:
        only those sites are copied (a config steers a few of the sites, a whole row is
        ``2 * sites * hidden * 4`` bytes)."""
        used = frozenset(self._site_index[s] for s in (*static, *dynamic, *projections))
        sites = sorted(used | self._written.get(row, frozenset()))
        self._written[row] = used
        self.entries[row] = row_entry(row, used, len(self.sites)) if self.site_groups else row
        self.entries_version += 1
        position = {i: k for k, i in enumerate(sites)}
        device = self.table.device
        host = _host_buffer((2, len(sites), self.hidden_size), torch.float32, device)
        flags = _host_buffer((len(sites),), torch.int32, device)
        for part, contents, flag in ((0, static, STATIC_FLAG), (1, dynamic, DYNAMIC_FLAG)):
            for site, vec in contents.items():
                k = position[self._site_index[site]]
                host[part, k] = torch.from_numpy(np.asarray(vec, dtype=np.float32))
                flags[k] |= flag
        d = self.max_projections
        proj = _host_buffer((len(sites), d, self.hidden_size + PROJ_PARAMS + d), torch.float32,
                            device)
        for site, items in projections.items():
            k = position[self._site_index[site]]
            _pack_projections(items, proj[k], self.hidden_size)
            flags[k] |= PROJECT_FLAG
        # Issued on the current stream: ordered after every forward that read the old contents.
        # Consecutive sites go in one copy.
        h, p = self.hidden_size, PROJ_PARAMS
        for first, last in _runs(sites):
            part = slice(position[first], position[last] + 1)
            rows = slice(first, last + 1)
            self.table[rows, row].copy_(host[0, part], non_blocking=True)
            self.dyn[rows, row].copy_(host[1, part], non_blocking=True)
            self.flags[rows, row].copy_(flags[part], non_blocking=True)
            if d:
                self.proj_dir[rows, row].copy_(proj[part, :, :h], non_blocking=True)
                self.proj_par[rows, row].copy_(proj[part, :, h:h + p], non_blocking=True)
                self.proj_gram[rows, row].copy_(proj[part, :, h + p:], non_blocking=True)


def _pack_projections(items: tuple[Projection, ...], out: torch.Tensor, hidden: int) -> None:
    """One site's projections into ``out[D, hidden + PROJ_PARAMS + D]``: directions, then
    (static, gated, value, norm), then the Gram matrix of the directions (float64 products).
    Norm-matched adds go after the ablate / clamp slots, which then see the stream as it came
    in (order is otherwise kept)."""
    items = tuple(sorted(items, key=lambda p: p.norm))
    directions = np.stack([p.direction for p in items]).astype(np.float32)
    out[:len(items), :hidden] = torch.from_numpy(directions)
    for i, p in enumerate(items):
        out[i, hidden + PROJ_STATIC] = p.static
        out[i, hidden + PROJ_GATED] = p.gated
        out[i, hidden + PROJ_VALUE] = p.value
        out[i, hidden + PROJ_NORM] = float(p.norm)
    d64 = directions.astype(np.float64)
    gram = torch.from_numpy((d64 @ d64.T).astype(np.float32))
    out[:len(items), hidden + PROJ_PARAMS:hidden + PROJ_PARAMS + len(items)] = gram


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as (first, last) runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host tensor to copy to ``device`` without waiting for the GPU.

    A copy from pageable memory first waits for everything queued on the stream (the forward in
    flight), stalling the step that admits a new config; from pinned memory it is queued behind
    that work instead. PyTorch's pinned allocator keeps the buffer until the copy has run.
    """
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


class ProbeTable:
    """Allocates probe rows (weights + threshold, sharpness, monitor site index)."""

    def __init__(self, sites: tuple[Site, ...], hidden_size: int, max_probes: int,
                 device: torch.device) -> None:
        self._site_index = {site: i for i, site in enumerate(sites)}
        self.probes = torch.zeros(max_probes + 1, hidden_size, dtype=torch.float32,
                                  device=device)
        self.params = torch.zeros(max_probes + 1, PARAMS, dtype=torch.float32, device=device)
        self._slots = _Slots(max_probes)

    @property
    def in_use(self) -> int:
        return self._slots.in_use

    def acquire(self, probe: ProbeRow, key: bytes | None = None) -> int | None:
        """A row holding ``probe``, shared by content; a caller's ``key`` that determines the
        probe finds its row again without hashing the weights. None when full."""
        if key is not None:
            row = self._slots.reuse(b"k" + key)
            if row is not None:
                return row
        site = self._site_index[probe.site]
        row, fresh = self._slots.take(_digest(probe.weights, probe.threshold, probe.sharpness,
                                              site))
        if row is not None and key is not None:
            self._slots.alias(b"k" + key, row)
        if fresh:
            device = self.probes.device
            host = _host_buffer((self.probes.shape[1] + PARAMS,), torch.float32, device)
            weights, params = host[:-PARAMS], host[-PARAMS:]
            weights[:] = torch.from_numpy(probe.weights.astype(np.float32))
            params[PARAM_THRESHOLD] = probe.threshold
            params[PARAM_SHARPNESS] = probe.sharpness
            params[PARAM_SITE] = float(site)
            self.probes[row].copy_(weights, non_blocking=True)
            self.params[row].copy_(params, non_blocking=True)
        return row

    def release(self, row: int) -> None:
        self._slots.give_back(row)
