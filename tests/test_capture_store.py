"""The filesystem sink and its reader (no engine): shards, index, backpressure, a killed
writer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from dynsteer import capture
from dynsteer.controller.activations import Activations, rows_from_bytes, rows_to_bytes

SITES = ("post_block@1", "pre_attn@3")


def request(i: int, dtype: str = "float32", width: int = 16) -> Activations:
    rng = np.random.default_rng(i)
    n = 3 + i % 5
    sites = {}
    for site in SITES:
        rows = rng.standard_normal((n, width)).astype(np.float32)
        sites[site] = rows_from_bytes(*_encoded(rows, dtype))
    return Activations(status="ok", positions=np.arange(i, i + n), sites=sites, dtype=dtype)


def _encoded(rows, dtype):
    data, scales = rows_to_bytes(rows, dtype)
    return data, dtype, rows.shape, scales


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_round_trip_across_shards(tmp_path, dtype):
    """Requests come back as written, in order, across several sealed shards; one site reads
    as all requests' rows."""
    written = [request(i, dtype) for i in range(12)]
    with capture.FilesystemSink(tmp_path, shard_bytes=600) as sink:
        for i, acts in enumerate(written):
            assert sink.write(f"req-{i}", acts, {"caller": f"c{i % 2}"})
    assert sink.counters.requests == 12 and sink.counters.shards > 2
    store = capture.open(tmp_path)
    assert len(store) == 12 and store.sites() == sorted(SITES)
    for i, (got, want) in enumerate(zip(store, written, strict=True)):
        assert got.request_id == f"req-{i}" and got.status == "ok"
        assert got.meta == {"caller": f"c{i % 2}"}
        np.testing.assert_array_equal(got.activations.positions, want.positions)
        for site in SITES:
            np.testing.assert_array_equal(got[site], want[site])
    np.testing.assert_array_equal(store.site("pre_attn@3"),
                                  np.concatenate([w["pre_attn@3"] for w in written]))
    assert not list(tmp_path.glob(".*")), "no temporary file is left"


def test_shards_are_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    with capture.FilesystemSink(tmp_path) as sink:
        sink.write("a", request(0))
        sink.write("b", request(1))
    (shard,) = tmp_path.glob("shard-*.safetensors")
    tensors = safetensors.load_file(str(shard))
    for line, i in zip(capture.open(tmp_path).lines, (0, 1), strict=True):
        entry = line["sites"]["post_block@1"]
        assert entry["tensor"].startswith("post_block@1/float32/16/")
        np.testing.assert_array_equal(tensors[entry["tensor"]][entry["start"]:entry["stop"]],
                                      request(i)["post_block@1"])
        np.testing.assert_array_equal(tensors[line["positions"]["tensor"]],
                                      request(i).positions)


def test_a_reopened_folder_continues_its_numbering(tmp_path):
    for batch in range(2):
        with capture.FilesystemSink(tmp_path) as sink:
            sink.write(f"r{batch}", request(batch))
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-000001.safetensors", "shard-000002.safetensors"]
    assert [r.request_id for r in capture.open(tmp_path)] == ["r0", "r1"]


class SlowSink(capture.FilesystemSink):
    """A sink whose writer waits for ``release`` before its first request."""

    def __init__(self, *args, **kwargs):
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def _add(self, request_id, activations, meta=None):
        self.release.wait()
        super()._add(request_id, activations, meta)


def test_drop_policy_counts_what_a_full_queue_refuses(tmp_path):
    sink = SlowSink(tmp_path, queue_size=2, policy="drop")
    results = [sink.write(f"r{i}", request(i)) for i in range(6)]
    sink.release.set()
    sink.close()
    # The queue holds two (and the writer one, if it took it in time): the rest is dropped.
    assert results.count(False) == sink.counters.dropped >= 3
    assert len(capture.open(tmp_path)) == sink.counters.requests == 6 - sink.counters.dropped


def test_block_policy_waits_instead(tmp_path):
    sink = SlowSink(tmp_path, queue_size=1, policy="block")
    writer = threading.Thread(target=lambda: [sink.write(f"r{i}", request(i))
                                              for i in range(4)])
    writer.start()
    writer.join(0.3)
    assert writer.is_alive(), "a full queue blocks the caller"
    sink.release.set()
    writer.join()
    sink.close()
    assert sink.counters.dropped == 0 and len(capture.open(tmp_path)) == 4


def test_a_failed_write_drops_its_requests_and_the_sink_goes_on(tmp_path, monkeypatch):
    from dynsteer.controller import capture_store

    real = capture_store.write_at
    calls = []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(capture_store, "write_at", full_disk)
    with capture.FilesystemSink(tmp_path) as sink:
        sink.write("lost", request(0))
        sink.flush()
        sink.write("kept", request(1))
    assert sink.counters.dropped == 1
    assert [r.request_id for r in capture.open(tmp_path)] == ["kept"]


def test_a_killed_writer_leaves_sealed_shards_and_an_index_naming_them(tmp_path):
    """A process killed while requests are queued and a shard is open: what is on disk is
    sealed shards and index lines that name them."""
    script = textwrap.dedent(f"""
        import os, numpy as np
        from dynsteer import capture
        from dynsteer.controller.activations import Activations
        sink = capture.FilesystemSink({str(tmp_path)!r}, shard_bytes=2000)
        for i in range(40):
            rows = np.full((8, 16), i, np.float32)
            sink.write(f"r{{i}}", Activations("ok", np.arange(8), {{"post_block@1": rows}},
                                             "float32"))
            if i == 25:
                sink.flush()
        os._exit(9)
    """)
    subprocess.run([sys.executable, "-c", script], check=False, timeout=120)
    store = capture.open(tmp_path)
    assert len(store) >= 26
    shards = {line["shard"] for line in store.lines}
    assert shards == {p.name for p in tmp_path.glob("shard-*.safetensors")}
    for i, got in enumerate(store):
        assert got.request_id == f"r{i}" and np.all(got["post_block@1"] == i)


def test_a_shard_is_sealed_once_its_running_requests_finish(tmp_path):
    """Blocks filled in pieces, out of order, by two requests sharing a shard: nothing is
    published while either runs; once both finish, the shard and both lines are, and the
    rows a request reserved but never filled read as zeros outside its line's range."""
    from dynsteer.controller.capture_shards import ShardWriter, write_at

    writer = ShardWriter(tmp_path, shard_bytes=1 << 20)
    rows = {r: np.arange(r * 100, r * 100 + 8 * 4, dtype=np.float32).reshape(8, 4)
            for r in (1, 2)}
    held = {r: writer.reserve({"rows": ("post_block@1/float32/4", np.dtype("<f4"), (8, 4))})
            for r in (1, 2)}
    assert held[1].shard is held[2].shard
    for r, first, stop in [(2, 4, 6), (1, 0, 3), (2, 0, 4), (1, 3, 5)]:
        write_at(held[r].fd, rows[r][first:stop], held[r].offsets["rows"] + first * 16)
    writer.finish(held[1], {"request_id": "r1", "status": "ok", "dtype": "float32",
                            "positions": None, "sites": {"post_block@1": {
                                "tensor": held[1].names["rows"], "start": 0, "stop": 5}}})
    writer.seal(force=True)
    assert capture.open(tmp_path).lines == [] and not list(tmp_path.glob("shard-*"))
    writer.finish(held[2], {"request_id": "r2", "status": "ok", "dtype": "float32",
                            "positions": None, "sites": {"post_block@1": {
                                "tensor": held[2].names["rows"], "start": 0, "stop": 6}}})
    writer.seal()
    store = capture.open(tmp_path)
    got = {r.request_id: r["post_block@1"] for r in store}
    np.testing.assert_array_equal(got["r1"], rows[1][:5])
    np.testing.assert_array_equal(got["r2"], rows[2][:6])
    (shard,) = tmp_path.glob("shard-*.safetensors")
    tensors = pytest.importorskip("safetensors.numpy").load_file(str(shard))
    assert not tensors[held[1].names["rows"]][5:].any()
    assert writer.counters.requests == 2 and writer.counters.shards == 1


def _stretch(request_id, site="post_block@1", offset=0):
    """A whole request of an engine sink: 4 rows of 2 float32 at ``site`` (``offset`` plus
    0 .. 7)."""
    import torch

    from dynsteer.engine_ext.worker import capture_sink

    tensors = {"rows": (f"{site}/float32/2", np.dtype("<f4"), (4, 2))}
    data = (torch.arange(8, dtype=torch.float32) + offset).view(torch.uint8)
    line = {"request_id": request_id, "status": "ok", "dtype": "float32", "positions": None,
            "sites": {site: {"tensor": "rows", "start": 0, "stop": 4}}}
    return capture_sink.Stretch(request_id, tensors, [("rows", data, 0, 32, 0)], line,
                                final=True)


def test_an_engine_sink_under_drop_counts_what_its_budget_refuses(tmp_path, monkeypatch):
    """The worker's sink with ``policy=drop``: while its thread is busy with a stretch, one
    that would pass the device-memory budget is dropped and its request counted dropped (no
    index line); the request that got through is read back whole."""

    from dynsteer.engine_ext.worker import capture_sink
    from dynsteer.engine_ext.worker.capture_transfer import PieceWriter

    busy = threading.Event()
    real = PieceWriter.write

    def slow(self, sources, computed):
        busy.wait(10)
        real(self, sources, computed)

    monkeypatch.setattr(PieceWriter, "write", slow)
    monkeypatch.setattr(capture_sink, "PENDING_BYTES", 40)
    sink = capture_sink.EngineSink("s", f"{tmp_path}?policy=drop")

    assert sink.send([_stretch("kept")])
    assert not sink.send([_stretch("lost")])
    busy.set()
    sink.close()
    assert sink.counters.dropped == 1 and sink.counters.requests == 1
    (kept,) = capture.open(tmp_path)
    assert kept.request_id == "kept"
    np.testing.assert_array_equal(kept["post_block@1"], np.arange(8).reshape(4, 2))


def test_a_full_disk_drops_the_engine_sinks_request_and_the_sink_goes_on(tmp_path,
                                                                          monkeypatch):
    """A write that fails (the disk is full) drops its request, counted, with no index line;
    the sink's thread keeps going and the next request is written whole; with the block
    policy nothing else is lost."""
    import errno

    from dynsteer.engine_ext.worker import capture_sink
    from dynsteer.engine_ext.worker.capture_transfer import PieceWriter

    real, failures = PieceWriter.write, [OSError(errno.ENOSPC, "No space left on device")]

    def full_once(self, sources, computed):
        if failures:
            raise failures.pop()
        real(self, sources, computed)

    monkeypatch.setattr(PieceWriter, "write", full_once)
    sink = capture_sink.EngineSink("s", f"{tmp_path}?policy=block")

    assert sink.send([_stretch("lost")]) and sink.send([_stretch("kept")])
    sink.close()
    assert sink.counters.dropped == 1 and sink.counters.requests == 1
    (kept,) = capture.open(tmp_path)
    assert kept.request_id == "kept"
    np.testing.assert_array_equal(kept["post_block@1"], np.arange(8).reshape(4, 2))


def test_the_pipeline_stages_lines_of_a_request_read_as_one(tmp_path):
    """Under pipeline parallelism each stage's writer has shards of its own
    (``shard-stageK-``) holding its layers' sites; the reader joins a request's lines."""
    from dynsteer.engine_ext.worker import capture_sink

    for stage, site in enumerate(("post_block@1", "post_block@3")):
        sink = capture_sink.EngineSink("s", str(tmp_path), tag=f"stage{stage}-")
        assert sink.send([_stretch("r", site, offset=100 * stage)])
        sink.close()
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("shard-*.safetensors")) == [
        "stage0", "stage1"]
    (request,) = capture.open(tmp_path)
    assert request.request_id == "r" and sorted(request.activations.sites) == [
        "post_block@1", "post_block@3"]
    np.testing.assert_array_equal(request["post_block@3"], 100 + np.arange(8).reshape(4, 2))


def test_a_sink_from_another_package_is_an_entry_point(controller_plugins):
    """``NAME=@plugin:ARG`` builds the entry point ``plugin`` of ``dynsteer.capture_sinks``
    with ``ARG``; a name no package provides is refused naming the sink and the group."""
    from dynsteer.engine_ext.server.sinks import build

    sinks = build({"mine": "@memory:tagged", "disk": str(controller_plugins / "acts")})
    mine = sinks["mine"]
    assert type(mine).__name__ == "MemorySink" and mine.arg == "tagged"
    rows = Activations(status="ok", positions=np.arange(2), sites={"post_block@1": np.ones((2, 4),
                       np.float32)}, dtype="float32")
    assert mine.write("r1", rows, {"caller": "-"}) and mine.counters["requests"] == 1
    assert isinstance(sinks["disk"], capture.FilesystemSink)
    for sink in sinks.values():
        sink.close()
    with pytest.raises(ValueError, match=r"capture_sinks\.other: no entry point 'absent' in "
                                         r"the group dynsteer\.capture_sinks"):
        build({"other": "@absent:x"})
