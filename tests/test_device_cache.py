"""benchmarks/device_cache.py: compile caches packed on one machine, unpacked on the next."""

from __future__ import annotations

import io
import lzma
import os
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import device_cache


def _tree(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file()}


def _cache(root: Path, name: str, files: dict[str, bytes]) -> Path:
    cache = root / name
    for rel, data in files.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    return cache


def test_round_trip_over_several_parts(tmp_path):
    """Two caches come back byte for byte under another root, through parts of the size
    asked for; a cache that does not exist is passed over."""
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    triton = _cache(src, "home/.triton/cache", {
        "ab/kernel.cubin": os.urandom(40_000), "ab/kernel.json": b'{"name": "k"}'})
    vllm = _cache(src, "home/.cache/vllm/torch_compile_cache", {
        "c0/rank_0_0/backbone/graph.py": b"def f(): pass\n" * 500})
    packed = device_cache.save(out, [triton, src / "missing", vllm], src, budget_mib=1,
                               part_mib=0.01)
    assert set(packed) == {str(triton), str(vllm)} and all(packed.values())
    parts = sorted(out.glob("devcache.part*"))
    assert len(parts) >= 4 and all(p.stat().st_size <= 0.01 * (1 << 20) for p in parts)
    assert device_cache.load(out, dst) > 0
    assert _tree(dst) == _tree(src)


def test_a_cache_over_the_budget_is_skipped_whole(tmp_path):
    """An incompressible cache larger than the budget is left out; the next, small one still
    fits, and only it is unpacked."""
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "out"
    big = _cache(src, "big", {"blob": os.urandom(300_000)})
    small = _cache(src, "small", {"a.json": b"{}"})
    packed = device_cache.save(out, [big, small], src, budget_mib=0.1, part_mib=15)
    assert packed[str(big)] == 0 and packed[str(small)] > 0
    device_cache.load(out, dst)
    assert _tree(dst) == {"small/a.json": b"{}"}


def test_load_refuses_an_entry_outside_the_root(tmp_path):
    """The archive is unpacked with tarfile's data filter: an entry naming a path outside the
    root is refused, and nothing is written there."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"no"))
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "devcache.part00").write_bytes(lzma.compress(buffer.getvalue()))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(tarfile.FilterError):
        device_cache.load(folder, root)
    assert not (tmp_path / "escaped").exists()


def test_a_second_save_replaces_the_first_parts(tmp_path):
    """Saving again into the same folder leaves only the new parts: an earlier, longer save's
    last parts would otherwise be joined to them on load."""
    src, out = tmp_path / "src", tmp_path / "out"
    big = _cache(src, "big", {"blob": os.urandom(50_000)})
    small = _cache(src, "small", {"a.json": b"{}"})
    device_cache.save(out, [big], src, budget_mib=1, part_mib=0.01)
    device_cache.save(out, [small], src, budget_mib=1, part_mib=0.01)
    assert len(list(out.glob("devcache.part*"))) == 1
    device_cache.load(out, tmp_path / "dst")
    assert _tree(tmp_path / "dst") == {"small/a.json": b"{}"}


def test_load_without_parts_unpacks_nothing(tmp_path):
    assert device_cache.load(tmp_path, tmp_path / "root") == 0
