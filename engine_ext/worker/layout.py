"""The data plane's layout: what each row and column of the worker's buffers holds.

Plain integers (no torch, no Triton), imported by the torch ops (:mod:`.ops`), the Triton
kernels (:mod:`.kernels`, which wrap them as ``tl.constexpr``), the per-token index
(:mod:`.token_rows`), the gate statistics (:mod:`.gate_stats`) and the controllers, so every
reader and writer of a buffer agrees on one definition and nothing imports a kernel module to
learn a column number. What the buffers mean is said where they are used (:mod:`.ops` for the
site op's, :mod:`.gate_stats` for the statistics).
"""

from __future__ import annotations

from collections.abc import Iterable

# ---- the site op's buffers (:class:`.ops.SteerBuffers`) ---------------------------------
STATIC_FLAG = 1
DYNAMIC_FLAG = 2
PROJECT_FLAG = 4
"""Bits of ``flags[row]``: the row uses ``table`` (static) / ``dyn`` (gated) / projection
slots (``proj_*``)."""
PROJ_STATIC, PROJ_GATED, PROJ_VALUE, PROJ_NORM = 0, 1, 2, 3
PROJ_PARAMS = 4
"""Columns of ``proj_par[row, slot]``: the slot's static coefficient, its gated coefficient
(times the token's gate), its target projection (0 for ``ablate``) and whether it is a
norm-matched add (1: the slot adds ``coefficient · ‖stream‖`` along its direction instead of
moving the stream's projection to the target)."""
PARAM_THRESHOLD, PARAM_SHARPNESS, PARAM_SITE = 0, 1, 2
PARAMS = 3
"""Columns of ``params[probe]``."""
INDEX_ROW, INDEX_PROBE, INDEX_CAPTURE, INDEX_CONTROL, INDEX_SLOT, INDEX_POS = range(6)
"""Rows of ``index``: steering row, probe row, capture row, controller row of each token; the
request slot and position of each token with a probe row (read by the gate statistics' fold
after the forward, :mod:`.gate_stats`, not by the op)."""
INDEX_ROWS = 6
POS_ABSOLUTE = 1 << 30
"""An ``INDEX_POS`` entry with this bit is the token's position (the bit cleared); without it,
the token's offset in its request's part of the step, counted from where the request's
previous step ended (so a decode step's entries do not change from step to step)."""
ROW_BITS = 13
"""Low bits of an ``INDEX_ROW`` entry: the token's steering row (``max_rows`` <= 4096)."""
ROW_MASK = (1 << ROW_BITS) - 1
SITE_GROUPS = 18
"""Bits of an ``INDEX_ROW`` entry above the row (below the sign bit): one per group of
consecutive sites, set where the token's row steers at a site of that group (see
:func:`site_bit`). A site without monitor reads the row only where its group's bit is set, so
a row that steers a few layers costs the other sites no row load, and the bits cost no load of
their own: they arrive with the row."""
CTL_KIND, CTL_FLOOR, CTL_SCALE, CTL_COUNT, CTL_P0, CTL_P1, CTL_P2 = range(7)
CTL_COLS = 8
"""Columns of ``control[k]``: the controller's kind (0: Python, run on the host; else a
built-in's ``kind``), the floor and scale the monitor applies, a counter, three parameters."""
KIND_LATCH, KIND_HYSTERESIS, KIND_PROPORTIONAL, KIND_BUDGET = 1, 2, 3, 4
"""The built-in controllers' kinds (:mod:`dynsteer.controller.controllers`)."""
GATE, SCORE = 0, 1
"""Rows of ``gate_score``."""


def site_bit(position: int, sites: int) -> int:
    """The ``INDEX_ROW`` bit of the group of the site at ``position`` of ``sites`` (groups of
    consecutive sites in forward order: a layer range is a few groups)."""
    return 1 << (ROW_BITS + position * SITE_GROUPS // sites)


def row_entry(row: int, positions: Iterable[int], sites: int) -> int:
    """The ``INDEX_ROW`` entry of ``row`` for contents at the sites at ``positions``."""
    entry = row
    for position in positions:
        entry |= site_bit(position, sites)
    return entry


MAX_NORM_ROW = 16384
"""The widest row ``dynsteer::steer_norm`` normalizes on CUDA (one block of at most 32 warps
holds the row)."""
PERSISTENT_SITE_ROW = 4096
"""The widest row whose fused site's kernel is asked to be a persistent reduction (engine
option ``persistent_sites``, :mod:`dynsteer.engine_ext.compat.inductor`). Inductor launches a
persistent kernel with at most 8 warps up to 8192 elements (16 elements a thread at 4096, 32
at 8192, where stock's persistent norm configs keep 16); the benchmarks cover rows up to 4096
(``benchmarks/overhead.py``), so wider rows keep Inductor's looped kernel."""


# ---- the gate statistics (:mod:`.gate_stats`) ------------------------------------------
GATE_ON = 0.5
"""A token counts as gated when its gate is above this."""

(FIRST_DYNAMIC, UPTO, MONITORED, GATED_PREFILL, GATED_DECODE, FIRST_DECODE_GATED, MAX_SCORE,
 FRONTIER, PROMPT_LEN, DYNAMIC_FROM, SITE, START, NEXT, FIRST_GATED) = range(14)
STAT_COLS = 14
"""Rows of ``stats`` (one value per slot each): the first two are the per-step read-back."""
OPS_HEAD = 3
"""The op buffer: [reads, writes, fold (0: the replay applies the ops only), read slots,
write slots, written columns (a write's ``STAT_COLS`` values in a row)]; each replay resets
the head to [0, 0, 1]."""


# ---- the device fill's slot table (:class:`.token_rows.SlotTable`) ----------------------
SLOT_PREFILL, SLOT_DECODE, SLOT_PROBE, SLOT_PROMPT_LEN = range(4)
"""Rows of the per-slot table the device fill reads
(:meth:`.token_rows.TokenRows.fill_from_slots`): a request slot's ``INDEX_ROW`` entry for
prompt positions and for generated positions, its probe row and its prompt length."""
SLOT_ROWS = 4
