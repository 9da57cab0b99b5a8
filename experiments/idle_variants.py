"""Where an idle fused site's GPU time goes: ``steer_add`` written differently, one engine each.

``benchmarks/launches.py --engine idle`` shows the whole idle cost of the default sites in the
add + RMSNorm kernels the sites fuse into (+1.1% GPU time per decode step of an 8B shape at
batch 32 on an H100; the three monitor kernels cost ~7 us of it). This runs the same
measurement with :func:`dynsteer.engine_ext.worker.ops.steer_add` replaced by a variant, to
tell the parts apart. Variants (none steers anything here: every token is on row 0):

* ``current``: the shipped form (site groups tied to ``h``, session 19);
* ``every-site``: the form shipped in sessions 14-18 (engine option ``site_groups: false``):
  a steered token's row read at every site;
* ``where-sum``: the form before (``where(|y| <= limit, y, x)`` on the steered sum ``y``);
* ``no-guard``: without the ``where`` that keeps a steered element within the stream limit;
* ``static``: the static tier only (no gate, no ``dyn`` row);
* ``gather``: plain row gathers (row 0 read as zeros) instead of masked loads;
* ``index``: the token's row index loaded and nothing steered, a floor for any design that
  reads a per-token index inside the norm kernel;
* ``gate-mask``: the dynamic tier's row read only where the gate is open (session 14, `a2873e6`);
* ``site-groups``: the row read only where the entry carries the site's group bit, as
  arithmetic on the entry (session 14, ``a9996ed``; here one fixed bit, which idle entries,
  all 0, never carry). Both cost 0.7-1.2% of a decode step in the engine where the stack
  microbenchmark said they would save. Session 15 found why (``experiments/codegen_diff.sh``):
  Inductor computed the site in the norm before the MLP, which reads ``x`` too, and stored
  ``delta`` as an fp32 buffer for the next norm to read;
* ``site-groups-tied``: ``site-groups`` with ``delta`` also dropped where ``h`` is NaN (no value
  changes), which ties the site to the kernel that adds ``h`` (session 15, ``3146929``);
* ``gate-indirect``: ``current`` with the gate read at an index computed from the loaded entry,
  an indirect load that Inductor's reduction heuristics do not count (session 33: the kernel
  then recomputed the residual from its two buffers in the second loop, 9 direct loads, and
  ran 4.64 us against current's 3.21 us at batch 32 on an H200);
* ``read-through-h``: the entry and gate read per element, at the token's column where ``h``
  is a number (session 33: 7.93 us per kernel; per-element indirect loads cost more than the
  config they were meant to win);
* ``int32-rows``: rows gathered by their int32 entries, one op fewer in the steered value
  (session 33: still stored on CUDA, 8 direct loads, 3.17 us per kernel against 3.21).

* ``plain-rows``: the token's row read from an index row of its own, with no site-group
  arithmetic (the op count a per-group row index, filled once per step, would give the site;
  idle entries are 0 either way, so this is exact for idle traffic). Still tied to ``h``
  (session 34, looped kernels: 3.20 us per kernel against current's 3.17, 8 direct loads; the
  mask no longer stored, the steered value still).

``--trace-realize`` prints each value Inductor stores and the rule that asked (session 33: on
CUDA the site's ``keep`` mask, 34 ops, and the steered residual, 31 ops, both past
``realize_opcount_threshold`` 30).
Session 34 raised that threshold (``--inductor realize_opcount_threshold=80``): 7 direct loads,
yet still only the looped config (3.04 us per kernel), since the persistent one is offered only
where it saves enough memory traffic; the engine option ``persistent_sites`` (default) asks
Inductor for a persistent kernel outright (2.29 us).

``--unfused-norm`` starts the engine with ``fused_norms: false``: each site and the norm
after it as two ops, as before session 26 (the site fused by Inductor into the norm's
kernel), instead of ``dynsteer::steer_norm``. The ``steer_add`` variants above only reach the
engine that way: with the default, ``current`` measures the sites in their norms' kernel.

``--looped-sites`` starts the engine with ``persistent_sites: false`` (session 34: by default the
kernels sites are fused into are persistent reductions; before, Inductor wrote them looped).

``--code DIR`` keeps Inductor's generated code (its cache directory) under ``DIR``, to diff
the kernels a site fuses into between variants.

Experiment code, not the product: variants are exact only for unsteered traffic.

Usage: python experiments/idle_variants.py --out DIR --variant NAME [--batch 32] [--code DIR]
       [--unfused-norm]
       python benchmarks/launches.py --compare DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")  # variants share a config hash

import launches
from overhead import LLAMA_8B
from site_cost import gate_masked_add, inductor_settings

from dynsteer.engine_ext.worker import ops, sites


def _no_guard(x, h, index, gate_score, table, dyn, *_):
    rows = index[ops.INDEX_ROW, :x.shape[0]].to(torch.long)
    gate = gate_score[ops.GATE, :x.shape[0]]
    y = x.to(torch.float32) + ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows)
    return y.to(x.dtype)


def _where_sum(x, h, index, gate_score, table, dyn, *_):
    rows = index[ops.INDEX_ROW, :x.shape[0]].to(torch.long)
    gate = gate_score[ops.GATE, :x.shape[0]]
    x32 = x.to(torch.float32)
    y = x32 + ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows)
    return torch.where(y.abs() <= ops.stream_limit(x.dtype), y, x32).to(x.dtype)


def _static(x, h, index, gate_score, table, *_):
    rows = index[ops.INDEX_ROW, :x.shape[0]].to(torch.long)
    x32 = x.to(torch.float32)
    y = x32 + ops._row_of(table, rows)
    return torch.where(y.abs() <= ops.stream_limit(x.dtype), y, x32).to(x.dtype)


def _gather(x, h, index, gate_score, table, dyn, *_):
    rows = index[ops.INDEX_ROW, :x.shape[0]].to(torch.long)
    gate = gate_score[ops.GATE, :x.shape[0]]
    x32 = x.to(torch.float32)
    y = x32 + table[rows] + gate[:, None] * dyn[rows]
    return torch.where(y.abs() <= ops.stream_limit(x.dtype), y, x32).to(x.dtype)


def _index(x, h, index, *_):
    rows = index[ops.INDEX_ROW, :x.shape[0]]
    return (x.to(torch.float32) + (rows != 0).to(torch.float32)[:, None]).to(x.dtype)


GROUP_SHIFT = 13
"""The site-group bit ``_site_groups`` tests (the row's bits are below it)."""


def _site_groups(x, h, index, gate_score, table, dyn, *_):
    entry = index[ops.INDEX_ROW, :x.shape[0]]
    rows = ((entry & ((1 << GROUP_SHIFT) - 1)) * ((entry >> GROUP_SHIFT) & 1)).to(torch.long)
    gate = gate_score[ops.GATE, :x.shape[0]]
    x32 = x.to(torch.float32)
    delta = ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows)
    return (x32 + ops._within_limit(x32, None, delta, x.dtype)).to(x.dtype)


def _site_groups_tied(x, h, index, gate_score, table, dyn, *_):
    """``site-groups`` tied to ``h``: ``delta`` also dropped where ``h`` is NaN (session 15,
    ``3146929``), so that Inductor can compute the site only in the kernel that adds ``h``."""
    entry = index[ops.INDEX_ROW, :x.shape[0]]
    rows = ((entry & ((1 << GROUP_SHIFT) - 1)) * ((entry >> GROUP_SHIFT) & 1)).to(torch.long)
    gate = gate_score[ops.GATE, :x.shape[0]]
    x32 = x.to(torch.float32)
    delta = ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows)
    keep = ((x32 + delta).abs() <= ops.stream_limit(x.dtype)) & ~torch.isnan(h)
    return (x32 + torch.where(keep, delta, 0.0)).to(x.dtype)


def _group_rows(entry: torch.Tensor, site_bit: int) -> torch.Tensor:
    """The rows the shipped form reads: the entry's row where it carries the site's bit, else 0."""
    return torch.where((entry & site_bit) != 0, entry & ops.ROW_MASK, 0)


def _steered(x: torch.Tensor, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The shipped form's last line: ``x`` plus ``delta`` where the sum is within the limit."""
    x32 = x.to(torch.float32)
    return (x32 + ops._within_limit(x32, h, delta, x.dtype)).to(x.dtype)


def _gate_indirect(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram, site_bit):
    """``current`` with the gate read at an index computed from the loaded entry (the token's
    own column where its entry carries the site's bit, else column 0): an indirect load, which
    Inductor's reduction heuristics do not count (session 33)."""
    n = x.shape[0]
    entry = index[ops.INDEX_ROW, :n]
    on = (entry & site_bit) != 0
    rows = _group_rows(entry, site_bit).to(torch.long)
    gate = gate_score[ops.GATE][torch.where(on, torch.arange(n, device=x.device), 0)]
    return _steered(x, h, ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows))


def _read_through_h(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram,
                    site_bit):
    """``current`` with the token's entry and gate read per element, at the token's column
    where ``h`` is a number and at column 0 where it is NaN (where the site adds nothing
    anyway): indirect loads, which Inductor's reduction heuristics do not count, so the norm
    kernel keeps stock's load count (session 33)."""
    column = torch.where(torch.isnan(h), 0, torch.arange(x.shape[0], device=x.device)[:, None])
    rows = _group_rows(index[ops.INDEX_ROW][column], site_bit).to(torch.long)
    gate = gate_score[ops.GATE][column]
    lanes = torch.arange(x.shape[1], device=x.device)
    return _steered(x, h, F.pad(table[1:], (0, 0, 1, 0))[rows, lanes]
                    + gate * F.pad(dyn[1:], (0, 0, 1, 0))[rows, lanes])


def _int32_rows(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram, site_bit):
    """``current`` with the rows gathered by their int32 entries (no conversion to int64): one
    op fewer in the steered value, whose 31 ops on CUDA pass Inductor's
    ``realize_opcount_threshold`` (30) and make it stored and reloaded (session 33's
    ``--trace-realize``); at 30 or fewer the fp32 sum would be stored instead, as on CPU (7
    direct loads)."""
    n = x.shape[0]
    rows = _group_rows(index[ops.INDEX_ROW, :n], site_bit)
    gate = gate_score[ops.GATE, :n]
    return _steered(x, h, ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows))


def _plain_rows(x, h, index, gate_score, table, dyn, proj_dir, proj_par, proj_gram, site_bit):
    """``current`` without the site-group arithmetic on the entry: the five ops that test the
    site's bit and mask the row off (a steered value of at most 30 ops on CUDA should stay
    inline, session 33)."""
    n = x.shape[0]
    rows = index[ops.INDEX_ROW, :n].to(torch.long)
    gate = gate_score[ops.GATE, :n]
    return _steered(x, h, ops._row_of(table, rows) + gate[:, None] * ops._row_of(dyn, rows))


def _every_site(*args):
    return ops.steer_add(*args[:9], 0)


VARIANTS = {"current": ops.steer_add, "every-site": _every_site, "gate-mask": gate_masked_add,
            "site-groups": _site_groups, "site-groups-tied": _site_groups_tied,
            "where-sum": _where_sum, "no-guard": _no_guard, "static": _static,
            "gather": _gather, "index": _index, "gate-indirect": _gate_indirect,
            "read-through-h": _read_through_h, "int32-rows": _int32_rows, "plain-rows": _plain_rows}


def trace_realize() -> None:
    """Print each pointwise value Inductor decides to store (its graph nodes, op count, reads
    and the lowering rule that asked), to tell which rule stores a site's value on this
    device (session 33: CUDA and CPU store different ones for the same graph)."""
    import traceback

    import torch._inductor.ir as ir

    realize = ir.StorageBox.realize

    def traced(self):
        if isinstance(self.data, ir.Pointwise):
            origins = sorted(node.name for node in self.data.origins)
            rule = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=6)[:-1]]
            print(f"realize {origins[:10]} ops={self.data.inner_fn_opcount().num_ops} "
                  f"reads={self.data.num_reads()} via {rule}", flush=True)
        return realize(self)

    ir.StorageBox.realize = traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--code", type=Path, default=None,
                        help="keep Inductor's generated code under this directory")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Inductor settings (integers) to compile under")
    parser.add_argument("--unfused-norm", action="store_true",
                        help="the site, then the norm (not dynsteer::steer_norm)")
    parser.add_argument("--looped-sites", action="store_true",
                        help="engine option persistent_sites false (Inductor's own launch)")
    parser.add_argument("--trace-realize", action="store_true",
                        help="print the values Inductor stores, and why (trace_realize)")
    args = parser.parse_args()
    if args.trace_realize:
        trace_realize()
    inductor = inductor_settings(args.inductor)
    name = "-".join(["idle", args.variant, *(["unfused"] if args.unfused_norm else []),
                     *(["looped"] if args.looped_sites else []),
                     *(f"{k}{v}" for k, v in inductor.items())])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.code is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.code.resolve() / name)
    sites.steer_add = VARIANTS[args.variant]
    path = Path(tempfile.mkdtemp()) / "llama32"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_8B))
    options = {**({"fused_norms": False} if args.unfused_norm else {}),
               **({"persistent_sites": False} if args.looped_sites else {})}
    llm = launches.start(path, options, 0.8, inductor)
    result = launches.per_step(llm, None, args.batch)
    print(f"{name}: {result['kernels']:.1f} kernels, {result['kernel_us']:.1f} GPU us per step")
    (args.out / f"launches_{name}.json").write_text(json.dumps(
        {"engine": name, "batch": args.batch, "per_decode_step": result}, indent=2))


if __name__ == "__main__":
    main()
