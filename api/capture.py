"""Captured activations on disk (see :mod:`dynsteer.controller.capture_store`)::

    from dynsteer import capture

    with capture.FilesystemSink("acts/") as sink:
        sink.write(out.request_id, steering.activations(out))
    store = capture.open("acts/")
    X = store.site("post_block@12")          # [tokens, hidden], every request
"""

from dynsteer.controller.capture_store import (
    CapturedRequest,
    CaptureStore,
    FilesystemSink,
    SinkCounters,
    open,
)

__all__ = ["CaptureStore", "CapturedRequest", "FilesystemSink", "SinkCounters", "open"]
