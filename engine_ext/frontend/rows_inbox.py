"""The frontend's inbox for collected rows: a private folder the workers write large replies
into (see :mod:`..worker.capture_transfer`), so they skip the RPC path's copies.

One per process, made on first use: under ``/dev/shm`` (memory, not disk) where it is a
writable folder, else the temporary folder; mode 0700, with a ``token`` file of random text
that a worker must read back to prove it sees the same folder.

A worker replies as soon as it has queued a reply's rows, before they are written: it writes
them into ``NAME`` + :data:`PART` and renames that to ``NAME`` when done, or leaves ``NAME`` +
:data:`FAILED` holding why it could not. A large reply is split into several such files
(:func:`parts`: ``NAME``, ``NAME.1``, ...), written at once: a tmpfs file takes one writer at
a time. So the frontend waits for the file (:func:`take`,
:func:`ready`), not the engine for the write. A reply's file is mapped and unlinked at once:
its rows stay readable while arrays refer to them, and nothing is left behind; a reply nobody
reads (its caller was cancelled) is removed with :func:`discard`, written or not. The folder
is removed when the process exits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from functools import cache

import numpy as np

SHM = "/dev/shm"
PART = ".part"
"""Suffix of a reply's file while the worker writes it."""
FAILED = ".failed"
"""Suffix of the file that says why a worker could not write a reply's file."""
WAIT_S = 600.0
"""How long the frontend waits for a reply's file before giving up on it."""
_POLL_S = (0.0005, 0.02)
"""The first and the longest pause between looks at a file not written yet."""


@cache
def inbox() -> dict[str, str] | None:
    """``{"folder", "token"}`` for the workers, or None when no folder can be made."""
    base = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None
    try:
        folder = tempfile.mkdtemp(prefix="dynsteer-rows-", dir=base)
        token = secrets.token_hex(16)
        with open(os.path.join(folder, "token"), "w") as f:
            f.write(token)
    except OSError:
        return None
    atexit.register(shutil.rmtree, folder, True)
    return {"folder": folder, "token": token}


def parts(path: str, count: int) -> list[str]:
    """The files of a reply of ``count`` parts whose first file is ``path``."""
    return [path if i == 0 else f"{path}.{i}" for i in range(count)]


def _own(path: str) -> None:
    box = inbox()
    if box is None or os.path.dirname(path) != box["folder"]:
        raise ValueError(f"{path!r} is not in this process's rows inbox")


def take(path: str) -> np.ndarray:
    """The bytes of a reply's file in the inbox (``uint8``, mapped copy-on-write, so the
    arrays made from it can be written), the file itself unlinked; waits until the worker
    has written it. OSError: the worker could not write it (why), or it did not come within
    :data:`WAIT_S`."""
    _own(path)
    for pause in _pauses(path):
        time.sleep(pause)
    _check_written(path)
    try:
        if os.path.getsize(path) == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="c")
    finally:
        os.unlink(path)


async def ready(path: str) -> None:
    """Wait, without blocking the event loop, until a reply's file is written or failed
    (:func:`take` then returns or raises at once)."""
    _own(path)
    for pause in _pauses(path):
        await asyncio.sleep(pause)


def discard(path: str) -> None:
    """Remove a reply's file unread, written or still being written (the worker then finds
    its file gone and drops the rows)."""
    _own(path)
    for name in (path, path + PART, path, path + FAILED):  # the rename may fall in between
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _pauses(path: str) -> Iterator[float]:
    """The pauses to wait, one after the other, while the file is neither written nor failed
    (growing, for at most :data:`WAIT_S` in all)."""
    pause, deadline = _POLL_S[0], time.monotonic() + WAIT_S
    while not (os.path.exists(path) or os.path.exists(path + FAILED)):
        if time.monotonic() > deadline:
            return
        yield pause
        pause = min(2 * pause, _POLL_S[1])


def _check_written(path: str) -> None:
    """OSError unless the file is there: why the worker failed, or that time is up."""
    if os.path.exists(path):
        return
    failed = path + FAILED
    if not os.path.exists(failed):
        discard(path)
        raise TimeoutError(f"{path}: the worker did not write it within {WAIT_S:.0f} s")
    with open(failed, encoding="utf-8", errors="replace") as f:
        why = f.read()
    os.unlink(failed)
    raise OSError(f"the worker could not write the rows: {why}")
