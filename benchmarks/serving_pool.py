"""Pooled serving latencies over several ``serving.py`` calls (its ``latencies.npz`` files).

One pair of runs cannot tell a 5% bound at ITL p99: on the lent machines the ratio of a single
pair ranged 0.90-1.36 for the same code. This pools every inter-token gap and TTFT of each
server over the calls (each file one pair or more, either order), prints the ratios of the
pooled percentiles (``--server`` over ``--base``), and bootstraps the ITL p99 ratio over
calls (calls drawn with replacement, then pooled), which gives its spread between machines
and orders rather than between tokens. It also pools the calls of each start order apart (which
server a call started first) and weighs the two orders equally, since on some machines the
server started first read worse whichever it was.

Beside each call's ITL p99 ratio it prints the ratio of the engine core's main-thread CPU
seconds per load (the same servers, from the call's ``serving.json``: the file with the
``.npz``'s stem and ``.json``, else ``serving.json`` in its folder), their correlation over the
calls, and the part of the plugin's extra engine CPU that its worker hooks do not account for,
per step. Sessions 43-45 found a call's ITL p99 ratio follows its engine CPU ratio (the
admitting steps that set the tail are host-bound), so a call whose p99 is off can be told
apart as one whose host ran the plugin's engine slower. Last, it splits every load (both
kinds) by whether its engine core's main thread stayed on one CPU (``proc_cpu``'s placement
samples) and prints each group's engine CPU and ITL p99 over the plain loads of the same
segment: session 46 found the loads that stayed on one CPU slower, for either kind. And it
reads every plugin load's ITL p99 against the plain loads of its own segment (median over
loads, bootstrapped over segments, with the second plain server over the first as the
control: :func:`by_segment`), which a half-speed stretch on one engine's CPUs (session 47)
moves far less than it moves the pooled p99.

Usage: python benchmarks/serving_pool.py A/latencies.npz B/latencies.npz ... [--json FILE]
       [--base vllm[,vllm-b]] [--server dynsteer[,dynsteer-variant]] [--draws 2000]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99, 99.9)
ENGINE_MAIN = "engine-core/main/"
"""How :mod:`proc_cpu` names the engine core's main thread (the step loop and the hooks)."""
HOOKS = ("admit", "finish", "step", "output")
"""The worker hooks whose time ``serving.py`` records per load (``worker_host``; the others
there are counters)."""


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


@dataclass(frozen=True)
class EngineCpu:
    """One kind's engine cores in one call, means per load."""

    seconds: float
    """The engine core's main-thread CPU seconds."""
    hooks: float
    """Of it, the dynsteer worker hooks' CPU seconds (0 for plain vLLM)."""
    steps: float
    """Steps (the ``step`` hook's calls; 0 where no hook ran)."""


def call_report(path: Path) -> dict[str, Any] | None:
    """The ``serving.json`` of the call whose ``.npz`` is ``path`` (see the module
    docstring); None where there is no such file."""
    report = next((p for p in (path.with_suffix(".json"), path.parent / "serving.json")
                   if p.is_file()), None)
    return None if report is None else json.loads(report.read_text())


def traced(report: dict[str, Any] | None) -> bool:
    """Whether the call (its :func:`call_report`) traced its servers (``serving.py
    --torch-profile``). Session 46's traced call ran every server slower after the trace
    than the untraced call minutes before on the same machine (vLLM's admitting steps +4 ms,
    its ITL p99 18-23 ms against 13-16 ms), so its tail is not comparable with an untraced
    call's."""
    return bool(report and report.get("torch_profile"))


def engine_seconds(run: dict[str, Any]) -> list[float]:
    """The load's engine-core main-thread CPU seconds (empty: no CPU window recorded)."""
    return [cpu for thread, cpu in run.get("cpu", {}).get("threads_cpu_s", {}).items()
            if thread.startswith(ENGINE_MAIN)]


def hook_seconds(run: dict[str, Any]) -> float:
    """The load's dynsteer worker hooks' CPU seconds (0 for plain vLLM)."""
    w = run.get("worker_host") or {}
    return sum(w[h]["calls"] * w[h]["mean_cpu_us"] for h in HOOKS if h in w) / 1e6


def engine_cpu(runs: list[dict[str, Any]], servers: str) -> EngineCpu | None:
    """The engine cores of the ``runs`` of ``servers`` (a comma list); None where they
    recorded no CPU window."""
    names = set(servers.split(","))
    mine = [run for run in runs if run["name"] in names]
    seconds = [cpu for run in mine for cpu in engine_seconds(run)]
    if not seconds:
        return None
    return EngineCpu(
        seconds=float(np.mean(seconds)),
        hooks=float(np.mean([hook_seconds(run) for run in mine])),
        steps=float(np.mean([(run.get("worker_host") or {}).get("step", {}).get("calls", 0.0)
                             for run in mine])))


ONE_CPU = 0.55
"""A load whose engine-core main thread was seen on one CPU in at least this share of its
placement samples ran there (not spread over the CPUs it may use)."""


def segment_groups(report: dict[str, Any] | None, keep: Callable[[dict[str, Any]], bool]
                   ) -> dict[Any, list[dict[str, Any]]]:
    """The loads of a call (its :func:`call_report`; None: none) that ``keep`` accepts, by
    segment: what :func:`by_placement` and :func:`by_segment` read each load against."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for run in [] if report is None else report["runs"]:
        if keep(run):
            groups.setdefault(run.get("segment"), []).append(run)
    return groups


def run_kinds(base: str, server: str) -> dict[str, str]:
    """Each run name of ``base`` and ``server`` (comma lists) -> ``"base"`` or ``"server"``."""
    return {name: kind for kind, names in (("base", base), ("server", server))
            for name in names.split(",")}


def by_placement(reports: list[dict[str, Any] | None], base: str, server: str
                 ) -> dict[str, Any]:
    """Every load of the calls (their :func:`call_report`; None: none), by kind (``base``,
    ``server``) and by whether its engine core's main thread stayed on one CPU
    (:data:`ONE_CPU`): the loads, the mean of their engine CPU less their
    hooks' and of their ITL p99, each over the mean of ``base``'s loads of the same call and
    segment; and the correlation of those two ratios over all loads. Session 46 found the
    loads that stayed on one CPU slower, for both kinds (from the placement samples that
    ``proc_cpu`` takes)."""
    kinds = run_kinds(base, server)
    loads: list[tuple[str, bool, float, float]] = []
    for report in reports:
        plain = segment_groups(  # the base loads with CPU
            report, lambda run: kinds.get(run["name"]) == "base" and bool(engine_seconds(run)))
        for run in [] if report is None else report["runs"]:
            place = next((v for k, v in run.get("cpu", {}).get("placement", {}).items()
                          if k.startswith(ENGINE_MAIN)), None)
            mine = plain.get(run.get("segment"))
            if run["name"] not in kinds or not place or not place["cpus"] or not mine \
                    or not engine_seconds(run):
                continue
            one_cpu = max(place["cpus"].values()) / sum(place["cpus"].values()) >= ONE_CPU
            cpu = (sum(engine_seconds(run)) - hook_seconds(run)) / np.mean(
                [sum(engine_seconds(r)) for r in mine])
            p99 = run["itl_ms_p99"] / np.mean([r["itl_ms_p99"] for r in mine])
            loads.append((kinds[run["name"]], one_cpu, float(cpu), float(p99)))
    groups = {}
    for kind in ("base", "server"):
        for one_cpu in (False, True):
            mine = [(c, p) for k, o, c, p in loads if k == kind and o == one_cpu]
            if mine:
                groups[f"{kind}, {'one CPU' if one_cpu else 'spread'}"] = {
                    "loads": len(mine),
                    "engine_cpu_less_hooks": float(np.mean([c for c, _ in mine])),
                    "itl_p99": float(np.mean([p for _, p in mine]))}
    out: dict[str, Any] = {"groups": groups}
    if len(loads) >= 3:
        out["correlation"] = float(np.corrcoef([c for *_, c, _ in loads],
                                               [p for *_, p in loads])[0, 1])
    return out


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
    half speed (session 47, ``vcpu_speed.py``), and such a stretch falls on either kind. A load
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


def engine_cpu_per_call(reports: list[dict[str, Any] | None], base: str, server: str
                        ) -> list[dict[str, float | None] | None]:
    """Per call (its :func:`call_report`; None: not recorded): ``server``'s engine CPU per
    load over ``base``'s (``ratio``), its hooks' seconds per load (``hooks_s``) and the extra
    seconds per load that its hooks do not account for, per step (``rest_us_per_step``; None:
    no hook recorded a step): sessions 43-45 found it near 0 in some calls and ~130 µs in
    others, where vLLM's own work in the plugin's engine ran slower."""
    out: list[dict[str, float | None] | None] = []
    for report in reports:
        runs = None if report is None else report["runs"]
        mine, theirs = ((engine_cpu(runs, server), engine_cpu(runs, base)) if runs is not None
                        else (None, None))
        if mine is None or theirs is None:
            out.append(None)
            continue
        rest = mine.seconds - theirs.seconds - (mine.hooks - theirs.hooks)
        out.append({"ratio": mine.seconds / theirs.seconds, "hooks_s": mine.hooks,
                    "rest_us_per_step": rest / mine.steps * 1e6 if mine.steps else None})
    return out


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
    for either server: sessions 39-40 saw the first-started server read ~4-6% worse."""
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
    reports = {f: call_report(f) for f in args.files}  # each call's serving.json, read once
    kept = [f for f in args.files if not traced(reports[f])]
    left_out = [str(f) for f in args.files if f not in kept]
    for name in left_out:
        print(f"left out {name}: its servers were traced (serving.py --torch-profile)")
    args.files, kept_reports = kept, [reports[f] for f in kept]
    if not args.files:
        ap.error("every call was traced: nothing to pool")
    calls = [{f"{role}_{what}": load(f, name, what)
              for role, name in (("base", args.base), ("server", args.server))
              for what in ("itl_s", "ttft_s")} for f in args.files]
    result: dict[str, Any] = {"files": [str(f) for f in args.files], "left_out": left_out,
                              "base": args.base, "server": args.server,
                              "itl": pooled(calls, "itl_s"), "ttft": pooled(calls, "ttft_s"),
                              "itl_p99_per_call": [pooled([c], "itl_s")["p99"] for c in calls],
                              "started_first": [started_first(f) for f in args.files],
                              "engine_cpu_per_call": engine_cpu_per_call(kept_reports, args.base,
                                                                         args.server)}
    known = [(p99, cpu["ratio"]) for p99, cpu in zip(result["itl_p99_per_call"],
                                                      result["engine_cpu_per_call"], strict=True)
             if cpu is not None]
    if len(known) >= 3:
        result["itl_p99_engine_cpu_correlation"] = float(np.corrcoef(np.array(known).T)[0, 1])
    result.update(by_start_order(calls, result["started_first"]))
    result["by_placement"] = by_placement(kept_reports, args.base, args.server)
    rng = np.random.default_rng(0)
    draws = [pooled([calls[i] for i in rng.integers(len(calls), size=len(calls))],
                    "itl_s")["p99"] for _ in range(args.draws)]
    result["itl_p99_bootstrap_5_50_95"] = [float(np.percentile(draws, q)) for q in (5, 50, 95)]
    result["by_segment"] = by_segment(kept_reports, args.base, args.server, rng, args.draws)
    print(f"{args.server} / {args.base}, {len(calls)} calls pooled")
    for what in ("itl", "ttft"):
        print(f"  {what}: " + "  ".join(f"{k} {v:.3f}" for k, v in result[what].items()))
    print("  ITL p99 per call: " + " ".join(f"{v:.3f}" for v in result["itl_p99_per_call"]))
    print("  engine-core main-thread CPU per call: " + " ".join(
        "-" if v is None else f"{v['ratio']:.3f}" for v in result["engine_cpu_per_call"]))
    if "itl_p99_engine_cpu_correlation" in result:
        print(f"  correlation of ITL p99 and engine CPU over calls: "
              f"{result['itl_p99_engine_cpu_correlation']:.2f}")
    print("  of the engine's extra CPU, not the hooks', µs a step: " + " ".join(
        "-" if v is None or v["rest_us_per_step"] is None else f"{v['rest_us_per_step']:+.0f}"
        for v in result["engine_cpu_per_call"]))
    low, mid, high = result["itl_p99_bootstrap_5_50_95"]
    print(f"  ITL p99 over calls, bootstrap 5/50/95%: {low:.3f} / {mid:.3f} / {high:.3f}")
    for first, ratio in result["itl_p99_by_first"].items():
        count = result["started_first"].count(first)
        print(f"  ITL p99, the {count} calls that started {first} first: {ratio:.3f}")
    if "itl_p99_order_balanced" in result:
        print(f"  ITL p99, both start orders weighted equally (geometric mean): "
              f"{result['itl_p99_order_balanced']:.3f}")
    print("  each load against plain vLLM's of its segment, by its engine core's placement:")
    for group, g in result["by_placement"]["groups"].items():
        print(f"    {group:<18} {g['loads']:>4} loads: engine CPU less hooks "
              f"{g['engine_cpu_less_hooks']:.3f}, ITL p99 {g['itl_p99']:.3f}")
    if "correlation" in result["by_placement"]:
        print(f"    correlation of the two over loads: "
              f"{result['by_placement']['correlation']:.2f}")
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
