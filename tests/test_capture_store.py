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
    np.testing.assert_array_equal(tensors["post_block@1/float32/16"],
                                  np.concatenate([request(0)["post_block@1"],
                                                  request(1)["post_block@1"]]))


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

    real = capture_store._write_safetensors
    calls = []

    def full_disk(path, tensors):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(capture_store, "_write_safetensors", full_disk)
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
