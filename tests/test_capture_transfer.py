"""How collected rows leave a worker (``worker/capture_transfer.py``) and reach the frontend
(``frontend/rows_inbox.py``), without an engine: through the inbox where the worker sees it,
else inline, with the same bytes."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import numpy as np
import pytest
import torch

from dynsteer.engine_ext.frontend import request_capture, rows_inbox
from dynsteer.engine_ext.worker import capture_transfer
from dynsteer.engine_ext.worker.capture_transfer import RowsSender


def blobs():
    return [torch.arange(n, dtype=torch.int32).view(torch.uint8) for n in (5, 0, 1000)]


def received(file, count, placed):
    files = [rows_inbox.take(path) for path in rows_inbox.parts(file, count)] if file else []
    return [bytes(p["data"]) if not files
            else files[p["part"]][p["offset"]:p["offset"] + p["nbytes"]].tobytes()
            for p in placed]


def test_rows_go_through_the_inbox_and_the_file_is_gone_once_mapped():
    file, count, placed = RowsSender().send(blobs(), rows_inbox.inbox())
    assert file is not None and os.path.dirname(file) == rows_inbox.inbox()["folder"]
    assert [p["nbytes"] for p in placed] == [20, 0, 4000]
    assert received(file, count, placed) == [b.numpy().tobytes() for b in blobs()]
    assert not os.path.exists(file)


def test_blobs_larger_than_a_write_arrive_whole_and_in_order(monkeypatch):
    """Blobs cut into many pieces, more than the writes in flight, each written at its own
    offset by the writer threads: the file holds every byte where the reply says."""
    monkeypatch.setattr(capture_transfer, "CHUNK", 7)
    rng = np.random.default_rng(0)
    many = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in (3, 50, 0, 7, 61)]
    file, count, placed = RowsSender().send(many, rows_inbox.inbox())
    assert file is not None and count == capture_transfer.WRITERS
    assert received(file, count, placed) == [b.numpy().tobytes() for b in many]


def test_an_inbox_the_worker_cannot_see_or_open_sends_inline(monkeypatch):
    box = rows_inbox.inbox()
    want = [b.numpy().tobytes() for b in blobs()]
    file, count, placed = RowsSender().send(blobs(), {**box, "token": "not the frontend's"})
    assert file is None and received(file, count, placed) == want
    assert RowsSender().send(blobs(), None)[0] is None
    real_open = os.open

    def full(path, *args):
        if path.endswith(rows_inbox.PART):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args)

    monkeypatch.setattr(capture_transfer.os, "open", full)
    file, count, placed = RowsSender().send(blobs(), box)
    assert file is None and received(file, count, placed) == want
    assert os.listdir(box["folder"]) == ["token"]


def test_a_file_the_worker_cannot_write_drops_its_requests_and_leaves_nothing(monkeypatch):
    """The disk fills while the sender writes, after the reply left: the frontend gets
    ``dropped`` with the reason for each request of that reply, and no file stays behind."""
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(capture_transfer.os, "pwrite", full)
    box = rows_inbox.inbox()
    file, count, placed = RowsSender().send(blobs(), box)
    item = {"status": "ok", "detail": "", "sites": ["post_block@0"], "hidden": 5,
            "dtype": "float32", "rows": 1, "positions": np.zeros(1, "<i8").tobytes(),
            "scales": b"", **placed[0]}
    reply = {"file": file, "parts": count, "items": [item, None]}
    [got, missing] = request_capture.merge([reply], 2)
    assert missing is None
    assert got.status == "dropped" and "No space left on device" in got.detail
    assert os.listdir(box["folder"]) == ["token"]


def test_the_reply_leaves_before_its_file_is_written(monkeypatch):
    """The engine does not wait for the write: ``send`` returns while the file is still
    being written, the frontend waits for it; a file discarded meanwhile is never
    published (the sender finds it gone)."""
    writing = threading.Event()
    real = capture_transfer._write_parts

    def slow(*args):
        writing.wait(10)
        real(*args)

    monkeypatch.setattr(capture_transfer, "_write_parts", slow)
    box = rows_inbox.inbox()
    sender = RowsSender()
    file, count, placed = sender.send(blobs(), box)
    assert not os.path.exists(file) and os.path.exists(file + rows_inbox.PART)
    threading.Timer(0.2, writing.set).start()
    assert received(file, count, placed) == [b.numpy().tobytes() for b in blobs()]

    writing.clear()
    file, count, placed = sender.send(blobs(), box)
    rows_inbox.discard(file)
    writing.set()
    sender._sender.submit(lambda: None).result()  # the sender is done with the file
    assert os.listdir(box["folder"]) == ["token"]


def test_the_frontend_maps_only_files_of_its_own_inbox(tmp_path):
    stray = tmp_path / "x.rows"
    stray.write_bytes(b"1234")
    with pytest.raises(ValueError, match="not in this process's rows inbox"):
        rows_inbox.take(str(stray))
    assert stray.exists()
    box = rows_inbox.inbox()
    assert oct(os.stat(box["folder"]).st_mode & 0o777) == "0o700"
    assert np.array_equal(rows_inbox.take(_file(box, b"")), np.zeros(0, np.uint8))


def _file(box, data):
    path = os.path.join(box["folder"], "empty.rows")
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_a_reply_whose_caller_was_cancelled_leaves_no_file():
    """The caller of a collect goes away (its client disconnected) while the workers reply:
    the reply still arrives, and its file is removed rather than left in the inbox."""
    async def scenario():
        reply = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(request_capture.collect_through(
            lambda method, *args: reply, [("r", None)]))
        await asyncio.sleep(0)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        file, count, placed = RowsSender().send(blobs(), rows_inbox.inbox())
        await rows_inbox.ready(file)
        assert os.path.exists(file)
        reply.set_result([{"file": file, "parts": count, "items": placed}, None])
        await asyncio.sleep(0)
        return caller, file

    caller, file = asyncio.run(scenario())
    assert caller.cancelled() and not os.path.exists(file)


def test_segments_of_one_blob_land_in_their_files_across_pieces(monkeypatch, tmp_path):
    """A blob cut into pieces of 7 bytes whose segments straddle the pieces and go to two
    files at their own offsets, out of blob order: every byte lands where its segment says."""
    from dynsteer.engine_ext.worker.capture_transfer import PieceWriter

    monkeypatch.setattr(capture_transfer, "CHUNK", 7)
    blob = torch.arange(30, dtype=torch.uint8)
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(2)]
    segments = [(fds[1], 20, 10, 0), (fds[0], 0, 12, 5), (fds[1], 12, 8, 40)]
    PieceWriter("test").write([(blob, segments)], None)
    for fd in fds:
        os.close(fd)
    first, second = (tmp_path / "f0").read_bytes(), (tmp_path / "f1").read_bytes()
    assert first == bytes(5) + bytes(range(12))
    assert second[:10] == bytes(range(20, 30)) and second[40:48] == bytes(range(12, 20))
