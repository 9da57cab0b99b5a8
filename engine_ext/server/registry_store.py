"""Durable registry of a server: one safetensors file per probe and per named vector.

Layout of the store folder (``--dynsteer-probe-store``): ``NAME.safetensors`` per probe and
``vectors/NAME.safetensors`` per registered vector, so a restarted server serves the same
probes *and* vectors. The server writes a file only for a change that passed the registry's
checks, under the lock that orders changes (:meth:`.runtime.DynsteerServer.apply`), so the store
holds exactly what the registry holds. Writes are atomic (temporary file in the same folder,
fsync, rename, fsync of the folder; see :func:`dynsteer.probes._io.atomic_write_bytes`), so after
a crash a file is the old or the new one, never a torn one; leftover temporary files
(``.NAME.safetensors.*.tmp``) are removed at the next start. A file that does not load is
reported and skipped, never served. Names follow :data:`dynsteer.probes.NAME_RULE` (no
separators, never hidden files).

Order: each file records when its name was first registered, as ``registered_ns`` (nanoseconds
since the epoch, and always later than any the store has loaded or given out, so it is a
sequence even when the clock is not) among the file's string metadata, beside the probe or
vector; replacing the name or changing its probe's threshold keeps it, and a file without it (a
probe saved elsewhere and copied in) counts from its modification time. The loaders return the
oldest first, so when a registry cap (``max_vectors``, ``max_probes``) is lower than what is
stored, the names registered longest ago come back; the others are moved to ``over-limit/``
beside them (:meth:`RegistryStore.set_aside_vector`, :meth:`RegistryStore.set_aside_probe`), out
of the store, and can be moved back once the cap is raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from dynsteer.probes import Probe, ProbeFileError
from dynsteer.probes._io import fsync_directory, read_probe_file, write_probe_file

logger = logging.getLogger("vllm.dynsteer.registry_store")

SUFFIX = ".safetensors"
VECTORS = "vectors"
"""Sub-folder of the registered vectors."""
OVER_LIMIT = "over-limit"
"""Sub-folder (of the probes' and of the vectors' folder) of entries a cap kept from coming back."""
REGISTERED_NS = "registered_ns"
"""File metadata key: when the name was first registered (see the module docstring)."""

T = TypeVar("T")


class RegistryStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.vector_folder = self.folder / VECTORS
        self.vector_folder.mkdir(parents=True, exist_ok=True)
        self._newest_ns = 0
        """The latest registration time loaded or given out: a new name gets a later one, even
        when the clock is behind the stored files' or too coarse to tell two writes apart."""

    # ---- probes --------------------------------------------------------------------------
    def save_probe(self, probe: Probe) -> None:
        path = self.folder / f"{probe.name}{SUFFIX}"
        probe.save(path, extra=self._order_of(path, "probe"))

    def delete_probe(self, name: str) -> None:
        _delete(self.folder / f"{name}{SUFFIX}")

    def set_aside_probe(self, name: str) -> Path:
        """Move the probe's file out of the store; returns the folder it went to."""
        return _set_aside(self.folder / f"{name}{SUFFIX}")

    def load_probes(self) -> list[Probe]:
        """Every valid probe in the folder, oldest first; cleans up interrupted writes."""

        def read(file: Path) -> tuple[str, Probe, dict[str, str]]:
            probe, extra = Probe.read(file)
            return probe.name, probe, extra

        return self._load_all(self.folder, "probe", read)

    # ---- vectors -------------------------------------------------------------------------
    def save_vector(self, name: str, vector: np.ndarray) -> None:
        path = self.vector_folder / f"{name}{SUFFIX}"
        write_probe_file(path, np.asarray(vector, dtype=np.float32), {"name": name},
                         kind="vector", extra=self._order_of(path, "vector"))

    def delete_vector(self, name: str) -> None:
        _delete(self.vector_folder / f"{name}{SUFFIX}")

    def set_aside_vector(self, name: str) -> Path:
        """Move the vector's file out of the store; returns the folder it went to."""
        return _set_aside(self.vector_folder / f"{name}{SUFFIX}")

    def load_vectors(self) -> list[tuple[str, np.ndarray]]:
        """Every valid (name, float32 vector) in the vector folder, oldest first."""

        def read(file: Path) -> tuple[str, tuple[str, np.ndarray], dict[str, str]]:
            values, header, extra = read_probe_file(file, kind="vector")
            name = str(header.get("name"))
            return name, (name, values), extra

        return self._load_all(self.vector_folder, "vector", read)

    # ---- order ---------------------------------------------------------------------------
    def _order_of(self, path: Path, kind: str) -> dict[str, str]:
        """The ``extra`` entry for a write of ``path``: the registration time of the file it
        replaces, or a new one."""
        try:
            registered = _registered_ns(read_probe_file(path, kind).extra, path)
        except (OSError, ProbeFileError):  # a new name (or a file that no longer loads)
            registered = max(time.time_ns(), self._newest_ns + 1)
        self._newest_ns = max(self._newest_ns, registered)
        return {REGISTERED_NS: str(registered)}

    def _load_all(self, folder: Path, kind: str,
                  read: Callable[[Path], tuple[str, T, dict[str, str]]]) -> list[T]:
        """What ``read`` makes of each file, oldest registration first (ties: by name);
        ``read`` returns the name the file holds, the item and the file's ``extra`` entries."""
        for leftover in folder.glob(f".*{SUFFIX}.*.tmp"):
            logger.warning("dynsteer: removing an interrupted %s write %s", kind, leftover.name)
            leftover.unlink(missing_ok=True)
        found: list[tuple[int, str, T]] = []
        for file in folder.glob(f"*{SUFFIX}"):
            try:
                name, item, extra = read(file)
                registered = _registered_ns(extra, file)
            except (ProbeFileError, OSError, ValueError) as e:
                logger.error("dynsteer: skipping %s file %s: %s", kind, file.name, e)
                continue
            if name != file.name.removesuffix(SUFFIX):
                logger.error("dynsteer: skipping %s: it holds %s %r", file.name, kind, name)
                continue
            found.append((registered, name, item))
            self._newest_ns = max(self._newest_ns, registered)
        found.sort(key=lambda entry: entry[:2])
        return [item for _, _, item in found]


def _registered_ns(extra: dict[str, str], file: Path) -> int:
    try:
        return int(extra[REGISTERED_NS])
    except (KeyError, ValueError):
        return file.stat().st_mtime_ns


def _delete(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fsync_directory(path.parent)


def _set_aside(path: Path) -> Path:
    aside = path.parent / OVER_LIMIT
    aside.mkdir(exist_ok=True)
    os.replace(path, aside / path.name)
    fsync_directory(aside)
    fsync_directory(path.parent)
    return aside
