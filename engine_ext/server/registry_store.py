"""Durable registry of a server: one safetensors file per probe and per named vector.

Layout of the store folder (``--dynsteer-probe-store``): ``NAME.safetensors`` per probe and
``vectors/NAME.safetensors`` per registered vector, so a restarted server serves the same
probes *and* vectors. Writes are atomic (temporary file in the same folder, fsync, rename, fsync
of the folder; see :func:`dynsteer.probes._io.atomic_write_bytes`), so after a crash a file is
the old or the new one, never a torn one; leftover temporary files (``.NAME.safetensors.*.tmp``)
are removed at the next start. A file that does not load is reported and skipped, never served.
Names follow :data:`dynsteer.probes.NAME_RULE` (no separators, never hidden files).
"""

from __future__ import annotations

import contextlib
import logging
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

T = TypeVar("T")


class RegistryStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.vector_folder = self.folder / VECTORS
        self.vector_folder.mkdir(parents=True, exist_ok=True)

    # ---- probes --------------------------------------------------------------------------
    def save_probe(self, probe: Probe) -> None:
        probe.save(self.folder / f"{probe.name}{SUFFIX}")

    def delete_probe(self, name: str) -> None:
        _delete(self.folder / f"{name}{SUFFIX}")

    def load_probes(self) -> list[Probe]:
        """Every valid probe in the folder; cleans up interrupted writes."""
        return _load_all(self.folder, "probe", Probe.load, lambda probe: probe.name)

    # ---- vectors -------------------------------------------------------------------------
    def save_vector(self, name: str, vector: np.ndarray) -> None:
        write_probe_file(self.vector_folder / f"{name}{SUFFIX}",
                         np.asarray(vector, dtype=np.float32), {"name": name}, kind="vector")

    def delete_vector(self, name: str) -> None:
        _delete(self.vector_folder / f"{name}{SUFFIX}")

    def load_vectors(self) -> list[tuple[str, np.ndarray]]:
        """Every valid (name, float32 vector) in the vector folder."""

        def read(file: Path) -> tuple[str, np.ndarray]:
            values, header = read_probe_file(file, kind="vector")
            return str(header.get("name")), values

        return _load_all(self.vector_folder, "vector", read, lambda item: item[0])


def _delete(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fsync_directory(path.parent)


def _load_all(folder: Path, kind: str, read: Callable[[Path], T],
              name_of: Callable[[T], str]) -> list[T]:
    for leftover in folder.glob(f".*{SUFFIX}.*.tmp"):
        logger.warning("dynsteer: removing an interrupted %s write %s", kind, leftover.name)
        leftover.unlink(missing_ok=True)
    items = []
    for file in sorted(folder.glob(f"*{SUFFIX}")):
        try:
            item = read(file)
        except (ProbeFileError, OSError, ValueError) as e:
            logger.error("dynsteer: skipping %s file %s: %s", kind, file.name, e)
            continue
        if name_of(item) != file.name.removesuffix(SUFFIX):
            logger.error("dynsteer: skipping %s: it holds %s %r", file.name, kind, name_of(item))
            continue
        items.append(item)
    return items
