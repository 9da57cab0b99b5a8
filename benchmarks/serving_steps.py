"""Engine steps as clients saw them: which admissions make a step slow (from serving.py's data).

``serving.py`` keeps every streamed chunk's arrival (``latencies.npz``). The chunks of one
engine step reach the clients as a burst, the bursts of consecutive steps a step apart, so
sorting all chunks of a run and cutting where the gap exceeds ``--burst-gap`` recovers the
steps: a step's time is from the previous burst's first chunk to its own. A step in which a
request's first chunk arrives ran that request's prefill. Printed per run: the decode steps'
duration, and the prefill steps' by the kind of request admitted (plain, static, gated), as
median / p90 / p99 ms and count; ``--json`` writes the same.

Usage: python benchmarks/serving_steps.py latencies.npz [--burst-gap 1.5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def steps_of(stamps: np.ndarray, chunks: np.ndarray, kinds: np.ndarray,
             burst_gap_s: float) -> dict[str, np.ndarray]:
    """Step durations (s) of one run by what the step admitted: ``decode`` (nothing) or the
    kind of the request whose first chunk it produced (several: the first one's)."""
    first = np.cumsum(chunks) - chunks  # index of each request's first chunk
    order = np.argsort(stamps, kind="stable")
    times = stamps[order]
    starts = np.flatnonzero(np.diff(times, prepend=-np.inf) > burst_gap_s)  # burst starts
    burst = np.cumsum(np.isin(np.arange(len(times)), starts)) - 1  # burst of each sorted chunk
    duration = np.diff(times[starts], prepend=np.nan)
    admitted = np.full(len(starts), "decode", dtype=object)
    where = np.empty(len(stamps), dtype=np.int64)
    where[order] = burst
    for request in np.argsort(stamps[first])[::-1]:  # earliest admission of a burst wins
        admitted[where[first[request]]] = str(kinds[request])
    keep = ~np.isnan(duration)
    return {kind: duration[keep & (admitted == kind)] for kind in sorted(set(admitted[keep]))}


def runs_of(npz: Any) -> list[str]:
    """The runs recorded in one ``latencies.npz`` (``<index>_<server>``), in run order."""
    names = {key.rsplit("_", 2)[0] for key in npz.files if key.endswith("_stamps_s")}
    return sorted(names, key=lambda name: int(name.split("_", 1)[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz", type=Path)
    ap.add_argument("--burst-gap", type=float, default=1.5,
                    help="ms between chunks that starts a new step's burst")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    npz = np.load(args.npz)
    out: dict[str, Any] = {}
    for run in runs_of(npz):
        steps = steps_of(npz[f"{run}_stamps_s"], npz[f"{run}_chunks"], npz[f"{run}_kind"],
                         args.burst_gap / 1e3)
        out[run] = {kind: {"steps": len(d), "p50_ms": float(np.percentile(d, 50) * 1e3),
                           "p90_ms": float(np.percentile(d, 90) * 1e3),
                           "p99_ms": float(np.percentile(d, 99) * 1e3)}
                    for kind, d in steps.items() if len(d)}
        print(run, "  ".join(f"{kind}: {v['p50_ms']:.2f} / {v['p90_ms']:.2f} / "
                             f"{v['p99_ms']:.2f} ms ({v['steps']})"
                             for kind, v in out[run].items()))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
