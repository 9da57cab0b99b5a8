"""Which launch configs Triton's autotuner chose for Inductor's kernels, engine by engine.

Where Inductor's heuristics leave a reduction kernel more than one launch config (a persistent
``R0_BLOCK`` beside a looped one when it marks the kernel ``add_persistent_rblock``), the kernel
times them at its first launch, which in vLLM is the profile run at thousands of tokens, and
stores the winner beside the kernel's source as a ``.best_config`` file that every later start
with the same cache reuses. A choice made on timing noise at that size would move a batch-1
decode step at every site that shares the kernel, one way or the other per compile: session 15's
lead for batch-1 ratios that took one of two values per engine start. Session 18 flipped the site
kernel's choice both ways (:func:`flip_rblock`) and found no effect within 0.05%: the spread is
between engine instances (``benchmarks/RESULTS.md``).

A benchmark snapshots the ``.best_config`` files under the caches before and after each engine's
start; the new ones are that engine's choices. A file is named by a hash of its kernel's source
(and torch's version), so the same name in two engines is the same kernel, and
:func:`disagreements` lists the kernels two engines tuned differently. An engine that wrote no
file for a kernel either tuned nothing there or reused a file another engine wrote into a shared
cache (``overhead.py --autotune own`` gives every engine its own).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

LAUNCH_KEYS = ("XBLOCK", "YBLOCK", "R0_BLOCK", "R1_BLOCK", "num_warps", "num_stages")
"""The fields of a ``.best_config`` that are the launch config (the rest are bookkeeping)."""
_KERNEL_DEF = re.compile(r"^def (triton_\w+)\(", re.MULTILINE)


def cache_roots() -> list[Path]:
    """Where vLLM and Inductor keep compiled kernels in this environment: vLLM's cache root
    (its per-configuration compile caches, whose ``inductor_cache`` folders vLLM may point
    Inductor at) and Inductor's own cache folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    vllm_root = os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm"))
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    return [Path(vllm_root), Path(inductor)]


def snapshot(roots: list[Path]) -> set[Path]:
    """Every ``.best_config`` file under ``roots`` now."""
    return {path for root in roots if root.is_dir() for path in root.rglob("*.best_config")}


def describe(paths: set[Path]) -> dict[str, dict[str, Any]]:
    """The choice recorded in each file, keyed ``<folder>/<file>`` (the same key for the same
    kernel source in any cache), with the Triton kernels defined beside it (a folder holds the
    kernels whose source hashes share two characters, so usually one) and whether each offered
    the persistent config; the whole path shows which cache the engine's compile used."""
    described = {}
    for path in sorted(paths):
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            described[f"{path.parent.name}/{path.name}"] = {"error": repr(e)}
            continue
        kernels = {}
        for source in sorted(path.parent.glob("*.py")):
            text = source.read_text(errors="replace")
            for name in _KERNEL_DEF.findall(text):
                kernels[name] = "'add_persistent_rblock': True" in text
        described[f"{path.parent.name}/{path.name}"] = {
            "path": str(path),
            "config": {k: recorded[k] for k in LAUNCH_KEYS if k in recorded},
            "time_taken_ms": recorded.get("time_taken_ms"),
            "kernels_beside": kernels,
        }
    return described


def disagreements(by_engine: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The kernels that two or more engines tuned, with different launch configs:
    ``{file: {engine: config}}``."""
    seen: dict[str, dict[str, Any]] = {}
    for engine, files in by_engine.items():
        for key, choice in files.items():
            if "config" in choice:
                seen.setdefault(key, {})[engine] = choice["config"]
    return {key: configs for key, configs in seen.items()
            if len(configs) > 1 and len({json.dumps(c, sort_keys=True)
                                         for c in configs.values()}) > 1}


def flip_rblock(files: dict[str, dict[str, Any]], name_part: str, persistent: int,
                looped: int = 2048) -> dict[str, list[int]]:
    """Rewrite the recorded choice of every kernel whose name contains ``name_part`` (and that
    offered both configs) to the other of its two ``R0_BLOCK`` values, ``persistent`` (the
    whole row) or ``looped``, in place: an engine that starts later on the same cache loads the
    other config for those kernels. Returns ``{file: [before, after]}``. A benchmark-only tool
    (``overhead.py --flip-site-rblock``) for an A/B of that one choice."""
    flipped = {}
    for key, choice in files.items():
        offered = [n for n, both in choice.get("kernels_beside", {}).items() if both]
        block = choice.get("config", {}).get("R0_BLOCK")
        if block not in (persistent, looped) or not any(name_part in n for n in offered):
            continue
        path = Path(choice["path"])
        recorded = json.loads(path.read_text())
        recorded["R0_BLOCK"] = looped if block == persistent else persistent
        path.write_text(json.dumps(recorded))
        flipped[key] = [block, recorded["R0_BLOCK"]]
    return flipped


class EngineChoices:
    """The autotune choices each engine's start wrote (use around the starts, in order)."""

    def __init__(self, extra_roots: list[Path] | None = None) -> None:
        self._roots = cache_roots() + list(extra_roots or [])
        self._before = snapshot(self._roots)
        self.by_engine: dict[str, dict[str, dict[str, Any]]] = {}
        self.flipped: dict[str, list[int]] = {}
        """What :func:`flip_rblock` changed before a later engine's start, if it ran."""

    def started(self, engine: str) -> None:
        """Attribute the files written since the last call to ``engine``."""
        now = snapshot(self._roots)
        self.by_engine[engine] = describe(now - self._before)
        self._before = now

    def report(self) -> dict[str, Any]:
        """For the benchmark's JSON: every engine's choices and where engines disagree."""
        return {"by_engine": self.by_engine, "disagreements": disagreements(self.by_engine),
                "roots": [str(r) for r in self._roots]}

    def summary_lines(self) -> list[str]:
        """One line per engine (files written; kernels beside them that offered the
        persistent config, with the config chosen) and one per disagreement."""
        lines = []
        for engine, files in self.by_engine.items():
            persistent = sorted(
                f"{name}={choice['config'].get('R0_BLOCK', '?')}"
                for choice in files.values() if "config" in choice
                for name, offered in choice["kernels_beside"].items() if offered)
            lines.append(f"autotune {engine}: {len(files)} choices written; persistent-capable "
                         f"kernels (R0_BLOCK chosen): {', '.join(persistent) or 'none'}")
        for key, configs in disagreements(self.by_engine).items():
            lines.append(f"autotune disagreement {key}: {json.dumps(configs, sort_keys=True)}")
        return lines
