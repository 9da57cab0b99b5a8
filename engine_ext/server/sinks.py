"""The server's capture sinks, built once at startup from ``ServerSettings.capture_sinks``.

A value is a folder (a :class:`dynsteer.capture.FilesystemSink`), optionally with its
settings as a query (``acts/?shard_bytes=67108864&policy=drop&seal_after_s=10``, also
``queue_size``), or ``@plugin:ARG``: the entry point ``plugin`` of the group
``dynsteer.capture_sinks``, called with ``ARG``. A sink has ``write(request_id, activations,
meta) -> bool`` (False: dropped), ``counters`` (requests, dropped, bytes, shards) and ``close()``;
sinks are closed (their open shard sealed) when the API server process exits.
"""

from __future__ import annotations

import atexit
from importlib.metadata import entry_points
from typing import Any

from dynsteer.controller.capture_store import FilesystemSink, sink_settings

GROUP = "dynsteer.capture_sinks"


def build(configured: dict[str, str]) -> dict[str, Any]:
    """Sinks by name (ValueError naming the sink when one cannot be made)."""
    sinks: dict[str, Any] = {}
    for name, value in configured.items():
        if value.startswith("@"):
            plugin, _, arg = value[1:].partition(":")
            found = [ep for ep in entry_points(group=GROUP) if ep.name == plugin]
            if not found:
                raise ValueError(f"capture_sinks.{name}: no entry point {plugin!r} in the "
                                 f"group {GROUP}")
            sinks[name] = found[0].load()(arg)
        else:
            folder, settings = sink_settings(name, value)
            sinks[name] = FilesystemSink(folder, **settings)
        atexit.register(sinks[name].close)
    return sinks
