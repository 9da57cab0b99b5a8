"""The steps around each admission, as the running requests saw them (serving.py's data).

``serving.py`` keeps every streamed chunk's arrival (``latencies.npz``). Every running request
gets one chunk per engine step, and the chunks of one step arrive together. So when request
``j``'s first chunk arrives, each other running request has a chunk within a fraction of a
step of it, and that request's gaps just before and after that chunk are the steps around
``j``'s admission. The median over the running requests gives one value per admission and
offset. Offset 0 is the gap that ends with the burst holding ``j``'s first chunk; -1 the one
before (with async scheduling, the step that ran ``j``'s prefill shows there); -2 and +1 are
the decode steps around them.

Printed per run and kind of request admitted (plain, static, gated): p50 / p90 / p99 ms of each
offset's gap over the admissions; with ``--pool``, per server over every run of every file
given (``--skip-first``: without each server's warm-up load). ``--json`` writes the same.

Usage: python benchmarks/serving_steps.py latencies.npz [...] [--pool [--skip-first]]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

OFFSETS = (-2, -1, 0, 1)
"""Gaps (in steps) relative to the one ending with the admitted request's first chunk."""
MARGIN_S = 0.03
"""A request counts as running at an admission when it streamed this long before and after."""


def around_admissions(stamps: np.ndarray, chunks: np.ndarray, kinds: np.ndarray
                      ) -> dict[str, np.ndarray]:
    """Per kind of request admitted: ``[admissions, len(OFFSETS)]`` gaps (s), each the
    median over the requests running then (admissions with none are left out)."""
    starts = np.cumsum(chunks) - chunks
    times = [stamps[s:s + n] for s, n in zip(starts, chunks, strict=True)]
    out: dict[str, list[np.ndarray]] = {}
    for j, mine in enumerate(times):
        first, rows = mine[0], []
        for i, theirs in enumerate(times):
            if i == j or theirs[0] > first - MARGIN_S or theirs[-1] < first + MARGIN_S:
                continue
            k = int(np.argmin(np.abs(theirs - first)))
            if -min(OFFSETS) < k < len(theirs) - max(OFFSETS):
                rows.append([theirs[k + o] - theirs[k + o - 1] for o in OFFSETS])
        if rows:
            out.setdefault(str(kinds[j]), []).append(np.median(np.array(rows), axis=0))
    return {kind: np.array(v) for kind, v in sorted(out.items())}


def admitting_step_ms(done: list[dict[str, Any]]) -> float | None:
    """The median over one load's admissions, of every kind, of the running requests' gap
    at offset -1 (the step that ran the prefill, as they saw it), in ms: the admitting step's
    length, which sets the ITL tail (about one gap in twelve at 16 requests/s) with less noise
    than the p99 of all gaps. ``done``: one load's requests (``stamps`` on one clock, ``kind``).
    None when no admission had requests running beside it."""
    if not done:
        return None
    chunks = np.array([len(r["stamps"]) for r in done])
    gaps = around_admissions(np.concatenate([r["stamps"] for r in done]), chunks,
                             np.array([r["kind"] for r in done]))
    if not gaps:
        return None
    return float(np.median(np.concatenate(list(gaps.values()))[:, OFFSETS.index(-1)]) * 1e3)


def runs_of(npz: Any) -> list[str]:
    """The runs recorded in one ``latencies.npz`` (``<index>_<server>``), in run order."""
    names = {key.rsplit("_", 2)[0] for key in npz.files if key.endswith("_stamps_s")}
    return sorted(names, key=lambda name: int(name.split("_", 1)[0]))


def run_gaps(npz: Any, run: str) -> dict[str, np.ndarray]:
    """:func:`around_admissions` of one run of a ``latencies.npz``."""
    return around_admissions(npz[f"{run}_stamps_s"], npz[f"{run}_chunks"], npz[f"{run}_kind"])


def pooled(files: list[Any], skip_first: bool) -> dict[str, dict[str, np.ndarray]]:
    """Per server and kind admitted, the :func:`around_admissions` rows of every run of every
    file (``skip_first``: each server's first run in each file left out, ``serving.py
    --warmup``'s load)."""
    out: dict[str, dict[str, list[np.ndarray]]] = {}
    for npz in files:
        seen: set[str] = set()
        for run in runs_of(npz):
            server = run.split("_", 1)[1]
            first = server not in seen
            seen.add(server)
            if first and skip_first:
                continue
            for kind, g in run_gaps(npz, run).items():
                out.setdefault(server, {}).setdefault(kind, []).append(g)
    return {server: {kind: np.concatenate(parts) for kind, parts in sorted(kinds.items())}
            for server, kinds in sorted(out.items())}


def _summary(name: str, gaps: dict[str, np.ndarray]) -> dict[str, Any]:
    """Print and return p50 / p90 / p99 (ms) of each offset's gap, per kind admitted."""
    out = {}
    for kind, g in gaps.items():
        row = {f"{o:+d}": [float(np.percentile(g[:, n], q) * 1e3) for q in (50, 90, 99)]
               for n, o in enumerate(OFFSETS)}
        out[kind] = {"admissions": len(g), "p50_p90_p99_ms": row}
        print(f"{name} {kind} ({len(g)}): " + "  ".join(
            f"{o}: {'/'.join(f'{v:.2f}' for v in vs)}" for o, vs in row.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz", type=Path, nargs="+")
    ap.add_argument("--pool", action="store_true",
                    help="pool every file's runs per server (serving.py calls of one setup)")
    ap.add_argument("--skip-first", action="store_true",
                    help="with --pool: leave out each server's first run in each file "
                         "(serving.py --warmup's load)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    files = [np.load(path) for path in args.npz]
    if args.pool:
        out = {server: _summary(server, gaps)
               for server, gaps in pooled(files, args.skip_first).items()}
    else:
        named = [(f"{path}:{run}" if len(files) > 1 else run, npz, run)
                 for path, npz in zip(args.npz, files, strict=True) for run in runs_of(npz)]
        out = {name: _summary(name, run_gaps(npz, run)) for name, npz, run in named}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
