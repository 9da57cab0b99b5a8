"""Engine steps in a vLLM torch-profiler trace, host and GPU side by side (GPU traces).

``serving.py --torch-profile STEPS`` has every server's worker trace STEPS engine steps of
its first load (vLLM's ``--profiler-config``; the step annotations are vLLM's own,
``execute_context_C(T)_generation_G(N)``). This reads such a trace (Kineto's Chrome JSON,
gzipped or not) and gives, per step: its kind (``admit``: a request's prompt is in it;
``decode``: generation only), the host time of ``execute_model`` (the annotation), and of the
GPU work launched inside it (matched by the launches' correlation ids, graph replays
included): kernels, busy time (sum of their durations), span (first start to last end) and
the wait before the first kernel. On the host side, the step's CPU operators and CUDA API calls
on its thread (aten and custom ops, graph launches, kernel launches, copies): count and time of
each name, and ``python_us``, the part of the step that no operator or API call covers (the
runner's own Python and hooks). Then per kind: medians, the GPU time per step of each kernel
(names with trailing digits folded, ``_0``/``_1`` of one Inductor source alike) and the calls
and time per step of each host operation.

``compare`` puts two traces side by side: for each kind, the medians of both and the kernels
whose time per step grew most. Where a server's admitting steps are slower than another's,
this says whether the GPU does more (busy time), waits (span above busy: launches late,
host-bound) or the host does (execute_model's own time), and then which host operations it
calls more often or longer, or whether the extra is Python between them (``python_us``).

Usage: python benchmarks/step_trace.py BASE_TRACE OTHER_TRACE [--top 25] [--out FILE]
       (a trace is a ``*.pt.trace.json[.gz]`` file or a folder holding one)
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

_STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_HOST_CATS = ("cpu_op", *_LAUNCH_CATS)


def trace_file(path: Path) -> Path:
    """``path`` itself, or the one trace in the folder ``path`` (the worker's; vLLM writes one
    per rank, and with ``ignore_frontend`` none for the API server)."""
    if path.is_file():
        return path
    found = sorted(path.rglob("*.pt.trace.json*"))
    if len(found) != 1:
        raise SystemExit(f"{path}: expected one *.pt.trace.json[.gz], found {len(found)}")
    return found[0]


def load_events(path: Path) -> list[dict[str, Any]]:
    path = trace_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernel_family(name: str) -> str:
    """A kernel's name without the trailing ``_<digits>`` Inductor numbers its kernels by,
    and without template arguments: kernels of one source group together across compiles."""
    return re.sub(r"(_\d+)+$", "", name.split("<", 1)[0])[:120]


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per annotated step, in time order (see the module docstring)."""
    launches: dict[int, list[tuple[float, int]]] = defaultdict(list)  # tid -> (ts, corr)
    host: dict[int, list[tuple[float, float, str]]] = defaultdict(list)  # tid -> (ts, dur, name)
    gpu: dict[int, list[dict[str, Any]]] = defaultdict(list)  # correlation -> GPU events
    marks = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat == "user_annotation" and _STEP.match(e.get("name", "")):
            marks.append(e)
        elif cat in _HOST_CATS:
            host[e["tid"]].append((e["ts"], e["dur"], e["name"]))
            if cat in _LAUNCH_CATS and "correlation" in e.get("args", {}):
                launches[e["tid"]].append((e["ts"], e["args"]["correlation"]))
        elif cat in _GPU_CATS and "correlation" in e.get("args", {}):
            gpu[e["args"]["correlation"]].append(e)
    for lst in (*launches.values(), *host.values()):
        lst.sort()
    out = []
    for m in sorted(marks, key=lambda e: e["ts"]):
        ctx, ctx_tokens, gen, gen_tokens = map(int, _STEP.match(m["name"]).groups())
        start, end = m["ts"], m["ts"] + m["dur"]
        mine = launches.get(m["tid"], [])
        first_launch = bisect.bisect_left(mine, (start, -1))
        last_launch = bisect.bisect_right(mine, (end, float("inf")))
        work = [g for _, corr in mine[first_launch:last_launch] for g in gpu.get(corr, [])]
        rec: dict[str, Any] = {
            "kind": "admit" if ctx else "decode", "context": ctx, "context_tokens": ctx_tokens,
            "generation": gen, "tokens": ctx_tokens + gen_tokens, "host_us": m["dur"],
            "kernels": len(work), "gpu_busy_us": sum(g["dur"] for g in work),
            "gpu_span_us": 0.0, "first_wait_us": 0.0, "by_kernel": defaultdict(float),
            **host_side(host.get(m["tid"], []), start, end)}
        if work:
            first = min(g["ts"] for g in work)
            rec["gpu_span_us"] = max(g["ts"] + g["dur"] for g in work) - first
            rec["first_wait_us"] = first - start
        for g in work:
            rec["by_kernel"][kernel_family(g["name"])] += g["dur"]
        out.append(rec)
    return out


def host_side(ops: list[tuple[float, float, str]], start: float, end: float) -> dict[str, Any]:
    """The host operations of ``ops`` (one thread's, sorted by start) that begin inside
    ``[start, end]``: calls and µs per name (nested ones counted in their own name too), and
    ``python_us``: the window less the union of the operations' spans."""
    first = bisect.bisect_left(ops, (start, -1.0, ""))
    last = bisect.bisect_right(ops, (end, float("inf"), ""))
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    covered, reach = 0.0, start
    for ts, dur, name in ops[first:last]:
        entry = by_op[name]
        entry[0] += 1
        entry[1] += dur
        stop = min(ts + dur, end)
        if stop > reach:
            covered += stop - max(ts, reach)
            reach = stop
    return {"by_host_op": by_op, "python_us": (end - start) - covered}


MEASURES = ("host_us", "python_us", "gpu_busy_us", "gpu_span_us", "first_wait_us", "kernels",
            "tokens")


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: the number of steps, the median of each measure, the deciles of the host time
    and the host times in step order (a process's host speed can change mid-trace: session
    30's plain vLLM went from 12.5 to 17 ms per admitting step and from 2.2 to 2.9 ms per
    decode step), the mean GPU time per step of each kernel family and the mean calls and
    host µs per step of each host operation."""
    kinds: dict[str, Any] = {}
    for kind in ("admit", "decode"):
        mine = [r for r in records if r["kind"] == kind]
        if not mine:
            continue
        per_kernel: dict[str, float] = defaultdict(float)
        per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for r in mine:
            for name, us in r["by_kernel"].items():
                per_kernel[name] += us / len(mine)
            for name, (calls, us) in r["by_host_op"].items():
                per_op[name][0] += calls / len(mine)
                per_op[name][1] += us / len(mine)
        hosts = [r["host_us"] for r in mine]
        kinds[kind] = {"steps": len(mine),
                       **{m: statistics.median(r[m] for r in mine) for m in MEASURES},
                       "host_us_deciles": (statistics.quantiles(hosts, n=10)
                                           if len(hosts) > 1 else hosts * 9),
                       "host_us_in_order": hosts,
                       "kernel_us_per_step": dict(per_kernel),
                       "host_op_per_step": {n: {"calls": c, "us": u}
                                            for n, (c, u) in per_op.items()}}
    return kinds


def summarize(path: Path) -> dict[str, Any]:
    """:func:`summary` of the steps of the trace at ``path`` (a file or its folder)."""
    return summary(steps(load_events(path)))


def compare(base: dict[str, Any], other: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """For each kind in both: the medians side by side, the kernel families whose GPU time
    per step grew most from ``base`` to ``other`` (and those only one of them ran), and the
    host operations whose time per step grew most (with their calls per step, both sides)."""
    out: dict[str, Any] = {}
    for kind in base.keys() & other.keys():
        a, b = base[kind], other[kind]
        ka, kb = a["kernel_us_per_step"], b["kernel_us_per_step"]
        grown = sorted(ka.keys() | kb.keys(), key=lambda n: ka.get(n, 0.0) - kb.get(n, 0.0))
        ha, hb = a.get("host_op_per_step", {}), b.get("host_op_per_step", {})
        none = {"calls": 0.0, "us": 0.0}
        ops_grown = sorted(ha.keys() | hb.keys(),
                           key=lambda n: ha.get(n, none)["us"] - hb.get(n, none)["us"])
        out[kind] = {
            "steps": [a["steps"], b["steps"]],
            **{m: [a[m], b[m]] for m in MEASURES},
            "host_us_deciles": [a["host_us_deciles"], b["host_us_deciles"]],
            "host_us_in_order": [a["host_us_in_order"], b["host_us_in_order"]],
            "kernels_grown_us": [[n, ka.get(n, 0.0), kb.get(n, 0.0)] for n in grown[:top]],
            "host_ops_grown": [[n, ha.get(n, none)["calls"], hb.get(n, none)["calls"],
                                ha.get(n, none)["us"], hb.get(n, none)["us"]]
                               for n in ops_grown[:top]],
        }
    return out


def print_comparison(names: tuple[str, str], table: dict[str, Any]) -> None:
    for kind, row in sorted(table.items()):
        print(f"\n{kind} steps ({row['steps'][0]} / {row['steps'][1]}), medians: "
              f"{names[0]} -> {names[1]}")
        for m in MEASURES:
            print(f"  {m:<14} {row[m][0]:>10.1f} {row[m][1]:>10.1f}")
        for name, deciles in zip(names, row["host_us_deciles"], strict=True):
            print(f"  host deciles, {name}: {' '.join(f'{d:.0f}' for d in deciles)}")
        print("  kernels whose GPU time per step grew most (µs):")
        for name, a, b in row["kernels_grown_us"]:
            print(f"  {b - a:>+9.1f} {a:>9.1f} {b:>9.1f}  {name}")
        print("  host operations whose time per step grew most (µs; calls per step):")
        for name, calls_a, calls_b, a, b in row["host_ops_grown"]:
            print(f"  {b - a:>+9.1f} {a:>9.1f} {b:>9.1f}  {calls_a:>7.1f} {calls_b:>7.1f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None, help="write the comparison as JSON")
    args = ap.parse_args()
    table = compare(summarize(args.base), summarize(args.other), args.top)
    print_comparison((args.base.name, args.other.name), table)
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
