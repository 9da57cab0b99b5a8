"""The frontend's inbox for collected rows: a private folder the workers write large replies
into (see :mod:`..worker.capture_transfer`), so they skip the RPC path's copies.

One per process, made on first use: under ``/dev/shm`` (memory, not disk) where it is a
writable folder, else the temporary folder; mode 0700, with a ``token`` file of random text
that a worker must read back to prove it sees the same folder. A reply's file is mapped and
unlinked at once: its rows stay readable while arrays refer to them, and nothing is left
behind; a reply nobody reads (its caller was cancelled) has its file removed with
:func:`discard`. The folder is removed when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import tempfile
from functools import cache

import numpy as np

SHM = "/dev/shm"


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


def _own(path: str) -> None:
    box = inbox()
    if box is None or os.path.dirname(path) != box["folder"]:
        raise ValueError(f"{path!r} is not in this process's rows inbox")


def take(path: str) -> np.ndarray:
    """The bytes of a reply's file in the inbox (``uint8``, mapped copy-on-write, so the
    arrays made from it can be written), the file itself unlinked."""
    _own(path)
    try:
        if os.path.getsize(path) == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="c")
    finally:
        os.unlink(path)


def discard(path: str) -> None:
    """Remove a reply's file unread."""
    _own(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
