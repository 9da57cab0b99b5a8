"""Garbage-collector pauses of a server's processes over a load, from ``gc_timing``'s files.

``serving.py --gc-log`` starts the servers with :mod:`gc_timing.sitecustomize` loaded, which
keeps each process's collections per generation in ``OUT/gc/gc_<pid>.json`` (cumulative,
written at most once a second). :class:`GcWindow` reads the files of a process tree before
and after a load: per process (labelled as :mod:`proc_cpu` labels them), the collections
and milliseconds of pause per generation in the window, and the longest pause so far.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proc_cpu import process_key, tree

GENERATIONS = 3


def read(folder: Path, pids: list[int]) -> dict[int, dict[str, Any]]:
    """The newest counts of each of ``pids`` that has a file (a process that never collected
    has none)."""
    found = {}
    for pid in pids:
        try:
            found[pid] = json.loads((folder / f"gc_{pid}.json").read_text())
        except (OSError, ValueError):
            continue
    return found


def window(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
           labels: dict[int, str]) -> dict[str, dict[str, list[float]]]:
    """Per process: ``count`` and ``ms`` per generation between the snapshots, ``max_ms``
    the longest pause per generation since the process started."""
    zero = {"count": [0] * GENERATIONS, "ns": [0] * GENERATIONS}
    out = {}
    for pid, now in after.items():
        then = before.get(pid, zero)
        out[labels.get(pid, str(pid))] = {
            "count": [a - b for a, b in zip(now["count"], then["count"], strict=True)],
            "ms": [round((a - b) / 1e6, 3) for a, b in zip(now["ns"], then["ns"], strict=True)],
            "max_ms": [round(n / 1e6, 3) for n in now["max_ns"]],
        }
    return out


class GcWindow:
    """``with GcWindow(root, folder) as gc: ...``; then ``gc.result`` (see :func:`window`;
    empty when ``folder`` is None)."""

    def __init__(self, root: int, folder: Path | None) -> None:
        self.root, self.folder = root, folder
        self.result: dict[str, dict[str, list[float]]] = {}

    def __enter__(self) -> GcWindow:
        if self.folder is not None:
            self._before = read(self.folder, tree(self.root))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.folder is None:
            return
        pids = tree(self.root)
        self.result = window(self._before, read(self.folder, pids),
                             {pid: process_key(pid) for pid in pids})


def describe(result: dict[str, dict[str, list[float]]]) -> str:
    """One line: each process's collections and pause ms per generation, longest pause."""
    return "; ".join(
        f"{name}: gen0/1/2 {'/'.join(map(str, r['count']))} collections, "
        f"{'/'.join(f'{m:.1f}' for m in r['ms'])} ms, longest {max(r['max_ms']):.1f} ms"
        for name, r in sorted(result.items()))
