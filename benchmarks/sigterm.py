"""SIGTERM as SystemExit in the GPU benchmarks, so what they started is stopped on the way out.

A device call that runs past its limit ends with ``timeout``'s SIGTERM. By default the
interpreter then dies at once: no ``finally``, no context manager, no ``atexit``. The servers
``serving.py`` started, or the engine cores of ``overhead.py``'s in-process engines, live on
and keep their GPU memory, and on a warm machine the next call's engines fail to start
("Free memory on device (19.8/139.8 GiB) on startup is less than desired").
Raised as SystemExit, the signal unwinds the script like any error does.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """Within the block SIGTERM raises ``SystemExit(128 + SIGTERM)``, the exit status a
    shell reports for the signal; the previous handler is restored after."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exits_on_sigterm(main: Callable[[], None]) -> Callable[[], None]:
    """``main`` run under :func:`stopped_by_sigterm`."""
    @functools.wraps(main)
    def run() -> None:
        with stopped_by_sigterm():
            main()

    return run
