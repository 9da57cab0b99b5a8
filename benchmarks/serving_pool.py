"""Pooled serving latencies over several ``serving.py`` calls (its ``latencies.npz`` files).

One pair of runs cannot tell a 5% bound at ITL p99: on the lent machines the ratio of a single
pair ranged 0.90-1.36 for the same code. This pools every inter-token gap and TTFT of each
server over the calls (each file one pair or more, either order), prints the ratios of the
pooled percentiles (``--server`` over ``--base``), and bootstraps the ITL p99 ratio over
calls (calls drawn with replacement, then pooled), which gives its spread between machines
and orders rather than between tokens. It also pools the calls of each start order apart (which
server a call started first) and weighs the two orders equally, since on some machines the
server started first read worse whichever it was.

Last, it reads every plugin load's ITL p99 against the plain loads of its own segment (median
over loads, bootstrapped over segments, with the second plain server over the first as the
control: :func:`by_segment`; it needs each call's ``serving.json``: the file with the
``.npz``'s stem and ``.json``, else ``serving.json`` in its folder), which a half-speed
stretch on one engine's CPUs moves far less than it moves the pooled p99.

Usage: python benchmarks/serving_pool.py A/latencies.npz B/latencies.npz ... [--json FILE]
       [--base vllm[,vllm-b]] [--server dynsteer[,dynsteer-variant]] [--draws 2000]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99, 99.9)
def load(path: Path, servers: str, what: str) -> np.ndarray:
    """Every ``what`` (``itl_s``, ``ttft_s``) sample of the runs of ``servers`` (a name, or a
    comma list whose runs are pooled: e.g. ``vllm,vllm-b`` against
    ``dynsteer,dynsteer-variant`` for a call that started two of each) in one file (keys
    ``<position>_<server>_<what>``)."""
    data = np.load(path, allow_pickle=False)
    keys = {f"{name}_{what}" for name in servers.split(",")}
    parts = [data[k] for k in data.files if k.split("_", 1)[1] in keys]
    if not parts:
        raise SystemExit(f"{path}: no {servers!r} run")
    return np.concatenate(parts)


def pooled(calls: list[dict[str, np.ndarray]], what: str) -> dict[str, float]:
    """Percentile ratios (server / base) of the samples of ``calls``, pooled."""
    base = np.concatenate([c[f"base_{what}"] for c in calls])
    other = np.concatenate([c[f"server_{what}"] for c in calls])
    return {f"p{q:g}": float(np.percentile(other, q) / np.percentile(base, q))
            for q in PERCENTILES}


def call_report(path: Path) -> dict[str, Any] | None:
    """The ``serving.json`` of the call whose ``.npz`` is ``path`` (see the module
    docstring); None where there is no such file."""
    report = next((p for p in (path.with_suffix(".json"), path.parent / "serving.json")
                   if p.is_file()), None)
    return None if report is None else json.loads(report.read_text())


def segment_groups(report: dict[str, Any] | None, keep: Callable[[dict[str, Any]], bool]
                   ) -> dict[Any, list[dict[str, Any]]]:
    """The loads of a call (its :func:`call_report`; None: none) that ``keep`` accepts, by
    segment: what :func:`by_segment` reads each load against."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for run in [] if report is None else report["runs"]:
        if keep(run):
            groups.setdefault(run.get("segment"), []).append(run)
    return groups


def run_kinds(base: str, server: str) -> dict[str, str]:
    """Each run name of ``base`` and ``server`` (comma lists) -> ``"base"`` or ``"server"``."""
    return {name: kind for kind, names in (("base", base), ("server", server))
            for name in names.split(",")}


SLOW = 1.10
""":func:`by_segment`: a load whose ITL p99 is this much over its segment's yardstick counts as
slow."""


def by_segment(reports: list[dict[str, Any] | None], base: str, server: str,
               rng: np.random.Generator, draws: int) -> dict[str, Any]:
    """Each load's ITL p99 over its segment's plain loads (their geometric mean), for every
    ``server`` load, and, as the control, every plain load but the first of its segment over
    that first one (``vllm-b`` over ``vllm``): the median over loads, bootstrapped over
    segments (5/50/95%), and the share of loads over :data:`SLOW`.

    Why: the pooled p99 of a few calls follows the stretches in which one engine's CPUs ran at
    half speed (the lent machines' vCPUs change speed 2x), and such a stretch falls on either
    kind. A load
    against the plain loads of its own segment (the same minute, the same requests) with the
    median over loads reads what is systematic; the share over :data:`SLOW` against the
    control's tells whether the plugin's engines draw slow stretches more often."""
    plain_names = base.split(",")
    kinds = run_kinds(base, server)
    segments: list[dict[str, list[float]]] = []
    for report in reports:
        for runs in segment_groups(
                report, lambda run: run["name"] in kinds and bool(run.get("itl_ms_p99"))
        ).values():
            plain = [r["itl_ms_p99"] for r in sorted(  # in ``base``'s order, not the run's
                (r for r in runs if kinds[r["name"]] == "base"),
                key=lambda r: plain_names.index(r["name"]))]
            if not plain:
                continue
            yardstick = float(np.exp(np.mean(np.log(plain))))
            segments.append({
                "server": [r["itl_ms_p99"] / yardstick for r in runs
                           if kinds[r["name"]] == "server"],
                "control": [p / plain[0] for p in plain[1:]]})

    def summary(kind: str) -> dict[str, Any] | None:
        ratios = [r for seg in segments for r in seg[kind]]
        if not ratios:
            return None
        picks = [rng.integers(len(segments), size=len(segments)) for _ in range(draws)]
        medians = [np.median([r for i in pick for r in segments[i][kind]] or [np.nan])
                   for pick in picks]
        return {"loads": len(ratios), "median": float(np.median(ratios)),
                "bootstrap_5_50_95": [float(np.nanpercentile(medians, q)) for q in (5, 50, 95)],
                "share_slow": float(np.mean(np.array(ratios) > SLOW))}

    return {"segments": len(segments), "server": summary("server"),
            "control": summary("control")}


def started_first(path: Path) -> str:
    """The server a call started first: the one whose run ``serving.py`` kept first (keys
    ``0_<server>_...``; with ``--interleave`` the order's first server serves segment 0 first)."""
    data = np.load(path, allow_pickle=False)
    first = [k for k in data.files if k.startswith("0_") and k.endswith("_itl_s")]
    if not first:
        raise SystemExit(f"{path}: no run kept first")
    return first[0][2:].removesuffix("_itl_s")


def by_start_order(calls: list[dict[str, np.ndarray]], firsts: list[str]
                   ) -> dict[str, Any]:
    """ITL p99 ratio pooled over the calls of each start order, and (where both orders are
    there) their geometric mean, which cancels an effect of starting first that is the same
    for either server: on some machines the first-started server read ~4-6% worse."""
    orders = {first: pooled([c for c, f in zip(calls, firsts, strict=True) if f == first],
                            "itl_s")["p99"] for first in sorted(set(firsts))}
    out: dict[str, Any] = {"itl_p99_by_first": orders}
    if len(orders) > 1:
        out["itl_p99_order_balanced"] = float(np.exp(np.mean(np.log(list(orders.values())))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--base", default="vllm")
    ap.add_argument("--server", default="dynsteer")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    reports = [call_report(f) for f in args.files]  # each call's serving.json, read once
    calls = [{f"{role}_{what}": load(f, name, what)
              for role, name in (("base", args.base), ("server", args.server))
              for what in ("itl_s", "ttft_s")} for f in args.files]
    result: dict[str, Any] = {"files": [str(f) for f in args.files],
                              "base": args.base, "server": args.server,
                              "itl": pooled(calls, "itl_s"), "ttft": pooled(calls, "ttft_s"),
                              "itl_p99_per_call": [pooled([c], "itl_s")["p99"] for c in calls],
                              "started_first": [started_first(f) for f in args.files]}
    result.update(by_start_order(calls, result["started_first"]))
    rng = np.random.default_rng(0)
    draws = [pooled([calls[i] for i in rng.integers(len(calls), size=len(calls))],
                    "itl_s")["p99"] for _ in range(args.draws)]
    result["itl_p99_bootstrap_5_50_95"] = [float(np.percentile(draws, q)) for q in (5, 50, 95)]
    result["by_segment"] = by_segment(reports, args.base, args.server, rng, args.draws)
    print(f"{args.server} / {args.base}, {len(calls)} calls pooled")
    for what in ("itl", "ttft"):
        print(f"  {what}: " + "  ".join(f"{k} {v:.3f}" for k, v in result[what].items()))
    print("  ITL p99 per call: " + " ".join(f"{v:.3f}" for v in result["itl_p99_per_call"]))
    low, mid, high = result["itl_p99_bootstrap_5_50_95"]
    print(f"  ITL p99 over calls, bootstrap 5/50/95%: {low:.3f} / {mid:.3f} / {high:.3f}")
    for first, ratio in result["itl_p99_by_first"].items():
        count = result["started_first"].count(first)
        print(f"  ITL p99, the {count} calls that started {first} first: {ratio:.3f}")
    if "itl_p99_order_balanced" in result:
        print(f"  ITL p99, both start orders weighted equally (geometric mean): "
              f"{result['itl_p99_order_balanced']:.3f}")
    segments = result["by_segment"]
    print(f"  each load's ITL p99 over its segment's plain loads ({segments['segments']} "
          f"segments; bootstrap over segments):")
    for kind, label in (("server", args.server), ("control", "plain over plain")):
        g = segments[kind]
        if g is not None:
            low, mid, high = g["bootstrap_5_50_95"]
            print(f"    {label:<26} {g['loads']:>4} loads: median {g['median']:.3f} "
                  f"({low:.3f} / {mid:.3f} / {high:.3f}), over {SLOW:.2f}: "
                  f"{g['share_slow']:.0%}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
