"""Where two servers' processes spent their time: py-spy raw stacks side by side.

``serving.py --py-spy BIN`` records every process of each server (``OUT/<run>.pyspy.txt.gz``:
one line per distinct stack, ``frame;frame;... samples``). This folds each file into seconds
per (process, thread, function), a function counted once per stack it is on (inclusive time),
and prints the functions whose time grew most from the first file to the second, per process
and thread: where the second server's extra host work is. Both servers served the same
request stream, so equal work reads as equal seconds; start-up (compile, graph capture) is in
both and cancels only roughly, so read the steady-state functions (the engine core's step,
the API server's request and output handlers).

Usage: python benchmarks/stacks.py BASE.pyspy.txt.gz OTHER.pyspy.txt.gz [--rate 100] [--top 40]
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path

_PROCESS = re.compile(r'process \d+:"([^"]*)";?')  # a command line may hold ';'
_THREAD = re.compile(r"^thread \(\w+\)(?:: (.*))?$")
_LINE = re.compile(r" \(([^():]*):\d+\)$")


def process_label(cmdline: str) -> str:
    """A short, run-independent name of a process from its command line."""
    for marker, label in (("EngineCore", "engine-core"), ("multiprocessing.spawn", "engine-core"),
                          ("Worker", "worker"),
                          ("APIServer", "api-server"), ("api_server", "api-server"),
                          ("cli serve", "api-server"),
                          ("compile_worker", "compile-worker")):
        if marker in cmdline:
            return label
    return cmdline.split(" ")[0][-40:] or "launcher"


def fold(path: Path, rate: float, under: str | None = None) -> Counter[tuple[str, str, str]]:
    """Seconds per (process, thread, function) in one raw stack file (inclusive); with
    ``under``, only stacks through a function whose name contains it."""
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
    seconds: Counter[tuple[str, str, str]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        processes = _PROCESS.findall(stack)
        process = process_label(processes[-1]) if processes else "launcher"
        thread, functions = "?", set()
        for frame in _PROCESS.sub("", stack).split(";"):
            found = _THREAD.match(frame)
            if found:
                thread = found.group(1) or "thread"
            elif frame:
                functions.add(_LINE.sub(r" (\1)", frame))  # one function, whatever its line
        if under is not None and not any(under in f for f in functions):
            continue
        for function in functions:
            seconds[process, thread, function] += int(count) / rate
        seconds[process, thread, "(all)"] += int(count) / rate
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's samples per second")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--under", default=None,
                    help="only stacks through a function whose name contains this (e.g. "
                         "run_busy_loop: the engine core's steady state)")
    args = ap.parse_args()
    base, other = fold(args.base, args.rate, args.under), fold(args.other, args.rate, args.under)
    print(f"{'process':<14} {'thread':<22} {args.base.name:>14} {args.other.name:>14}")
    for key in sorted({k[:2] for k in base} | {k[:2] for k in other}):
        print(f"{key[0]:<14} {key[1][:22]:<22} {base[(*key, '(all)')]:>13.1f}s "
              f"{other[(*key, '(all)')]:>13.1f}s")
    grown = sorted(set(base) | set(other), key=lambda k: other[k] - base[k], reverse=True)
    print(f"\nfunctions whose time grew most ({args.base.name} -> {args.other.name}):")
    for key in grown[: args.top]:
        print(f"{other[key] - base[key]:>+8.2f}s {base[key]:>8.2f}s {other[key]:>8.2f}s  "
              f"{key[0]}/{key[1][:16]}  {key[2][:110]}")


if __name__ == "__main__":
    main()
