"""Compile caches from one lent GPU machine to the next, so a fresh machine's engines start warm.

Each fresh machine starts from a bare image: its first engine spent ~110 s JIT-compiling the V2
runner's Triton kernels after graph capture (session 32, ``warmup_kernels``), and each dynsteer
configuration 60-70 s in torch.compile, minutes of a 30-minute device budget before anything is
measured. Those results sit in caches whose keys should not depend on the machine (the same
image, GPU and paths every time; the benchmark models' paths are content-keyed,
:mod:`bench_model`). Not yet used on a device (written in session 32): its first use shows
what the caches weigh and whether a warm start follows.

``save`` packs each cache that exists as a ``.tar.xz`` (in priority order, whole directories
only, while the packed total fits a budget) and splits them into parts small enough to come
back from a call (the device tool returns at most 8 files of 16 MiB); ``load`` joins the parts
and unpacks them where they came from. Entries are stored relative to ``--root`` and unpacked
with tarfile's ``data`` filter, so an archive cannot write outside it.

On the GPU machine, at the end of a call that started engines:
    python benchmarks/device_cache.py save --out $OUT/cache
Here, keep what came back in a git-ignored folder (``.devcache/``); on a fresh machine, in a
call of its own after the kit's install (the carried files count towards the call's 64 MiB):
    python benchmarks/device_cache.py load .devcache
"""

from __future__ import annotations

import argparse
import io
import lzma
import os
import tarfile
from pathlib import Path

MIB = 1 << 20
CACHES = ("~/.triton/cache", "~/.cache/vllm/torch_compile_cache", "/tmp/torchinductor_{user}",
          "~/.cache/flashinfer")
"""Where the compiled artifacts live, most useful first: Triton's binaries (the runner's
kernels and Inductor's), vLLM's compile cache (graphs and AOT artifacts), Inductor's own
cache, FlashInfer's JIT."""
PART = "devcache.part"
RATIO = 10
"""A cache more than this many times the budget left, unpacked, is not packed: xz does not
shrink compiled code that much."""


def default_caches() -> list[Path]:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "root"
    return [Path(os.path.expanduser(c.format(user=user))) for c in CACHES]


def raw_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def pack(cache: Path, root: Path) -> bytes:
    """One cache directory as a ``.tar.xz`` (entries relative to ``root``)."""
    buffer = io.BytesIO()
    with lzma.open(buffer, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(cache, arcname=str(cache.resolve().relative_to(root.resolve())))
    return buffer.getvalue()


def save(out: Path, caches: list[Path], root: Path, budget_mib: float, part_mib: float
         ) -> dict[str, int]:
    """Pack each cache that exists, in order, while the packed total stays within the budget
    (a cache over what is left is skipped whole; a later, smaller one may still fit), and
    write the archives, one after the other, as parts of at most ``part_mib`` under ``out``.
    Returns each cache's packed bytes (0: skipped)."""
    left = int(budget_mib * MIB)
    packed: dict[str, int] = {}
    archives: list[bytes] = []
    for cache in caches:
        if not cache.is_dir():
            continue
        if raw_size(cache) > RATIO * left:  # not worth packing to find it does not fit
            packed[str(cache)] = 0
            continue
        archive = pack(cache, root)
        fits = len(archive) <= left
        packed[str(cache)] = len(archive) if fits else 0
        if fits:
            archives.append(archive)
            left -= len(archive)
    data = b"".join(archives)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{PART}*"):  # an earlier save's parts would be joined to these
        stale.unlink()
    step = int(part_mib * MIB)
    for i in range(0, len(data), step):
        (out / f"{PART}{i // step:02d}").write_bytes(data[i:i + step])
    return packed


def load(folder: Path, root: Path) -> int:
    """Join ``folder``'s parts (in name order) and unpack the archives in them under
    ``root``; returns the number of entries unpacked (0 when the folder holds no parts)."""
    parts = sorted(folder.glob(f"{PART}*"))
    if not parts:
        return 0
    data = b"".join(p.read_bytes() for p in parts)  # xz streams, one after the other
    with lzma.open(io.BytesIO(data)) as xz, \
            tarfile.open(fileobj=xz, mode="r:", ignore_zeros=True) as tar:
        members = tar.getmembers()
        tar.extractall(root, members=members, filter="data")
    return len(members)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("save", help="pack the caches into parts under --out")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--budget-mib", type=float, default=56.0,
                   help="packed size at most (a call returns 64 MiB and carries 64 MiB)")
    s.add_argument("--part-mib", type=float, default=15.0)
    s.add_argument("--root", type=Path, default=Path("/"))
    s.add_argument("caches", nargs="*", type=Path, help="default: " + ", ".join(CACHES))
    lo = sub.add_parser("load", help="unpack the parts in a folder")
    lo.add_argument("folder", type=Path)
    lo.add_argument("--root", type=Path, default=Path("/"))
    args = ap.parse_args()
    if args.verb == "save":
        packed = save(args.out, args.caches or default_caches(), args.root, args.budget_mib,
                      args.part_mib)
        for cache, size in packed.items():
            print(f"{cache}: {size / MIB:.1f} MiB packed" if size
                  else f"{cache}: skipped (over the budget)")
        parts = sorted(args.out.glob(f"{PART}*"))
        total = sum(p.stat().st_size for p in parts)
        print(f"{len(parts)} part(s), {total / MIB:.1f} MiB packed under {args.out}")
    else:
        print(f"{load(args.folder, args.root)} entries unpacked from {args.folder}")


if __name__ == "__main__":
    main()
