"""Durable probe registry of a server: one safetensors file per probe in a folder.

Writes go through :meth:`dynsteer.probes.Probe.save` (temporary file in the same folder, fsync,
rename, fsync of the folder), so after a crash a probe file is the old or the new one, never a
torn one; leftover temporary files (``.NAME.safetensors.*.tmp``) are ignored and removed at the
next start. A file that does not load is reported and skipped, never served.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from dynsteer.probes import Probe, ProbeFileError
from dynsteer.probes._io import fsync_directory

logger = logging.getLogger("vllm.dynsteer.probe_store")

SUFFIX = ".safetensors"


class ProbeStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        """File of a probe (names are ``[A-Za-z0-9_.-]{1,64}``: no separators, never hidden)."""
        return self.folder / f"{name}{SUFFIX}"

    def save(self, probe: Probe) -> None:
        probe.save(self.path(probe.name))

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(name).unlink()
        fsync_directory(self.folder)

    def load_all(self) -> list[Probe]:
        """Every valid probe in the folder, by name; cleans up interrupted writes."""
        for leftover in self.folder.glob(f".*{SUFFIX}.*.tmp"):
            logger.warning("dynsteer: removing an interrupted probe write %s", leftover.name)
            leftover.unlink(missing_ok=True)
        probes = []
        for file in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                probe = Probe.load(file)
            except (ProbeFileError, OSError, ValueError) as e:
                logger.error("dynsteer: skipping probe file %s: %s", file.name, e)
                continue
            if probe.name != file.name.removesuffix(SUFFIX):
                logger.error("dynsteer: skipping %s: it holds probe %r", file.name, probe.name)
                continue
            probes.append(probe)
        return probes
