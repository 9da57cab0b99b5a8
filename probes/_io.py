"""Bytes on disk for probes and vectors: safetensors files, atomic writes.

This module knows nothing about :class:`~dynsteer.probes.Probe`; it moves a float32 vector and a
JSON header (their base64 form for HTTP is :func:`dynsteer.controller.contract.encode_f32`).
Nothing here unpickles: safetensors is a plain header + raw-bytes format, and the header is
parsed here (bounded, JSON only) before the safetensors library sees the data, so that garbage
files fail with a message that says what is wrong.

File layout (safetensors): one tensor ``weights`` (F32, shape ``[hidden_size]``) and string
metadata ``{"format": "dynsteer.probe", "format_version": "1", "probe": <JSON header>,
"weights_sha256": <hex>}``; registered steering vectors use the same layout with
``"format": "dynsteer.vector"`` and a ``"vector"`` header. The checksum exists because
safetensors itself does not detect a flipped byte in the tensor data, and a silently corrupted
probe would steer the wrong tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dynsteer.controller.contract import F32, f32_bytes

FORMAT_VERSION = 1
TENSOR_KEY = "weights"
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Refuse absurd header lengths before allocating (a probe header is a few hundred bytes)."""


class ProbeFileError(ValueError):
    """A file or payload that is not a valid dynsteer probe; the message says why."""


# --- atomic writes ----------------------------------------------------------------------------


def atomic_write_bytes(path: str | PathLike[str], data: bytes, *, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a mix.

    The temporary file lives in the target directory (``os.replace`` is only atomic within one
    filesystem), is fsynced before the rename, and is removed if anything fails. The directory is
    fsynced afterwards (best effort) so the rename itself survives a crash. ``mode`` is applied
    explicitly because ``mkstemp`` creates files readable by the owner only.
    """
    target = Path(path)
    directory = target.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_directory(directory)
    return target


def fsync_directory(directory: Path) -> None:
    """Persist a rename; not supported everywhere (e.g. Windows), hence best effort."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        dir_fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


# --- safetensors --------------------------------------------------------------------------------


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving and loading probe files needs the 'safetensors' package: "
            "pip install 'safetensors>=0.4'"
        ) from e
    return safetensors.numpy


def _weights_sha256(weights: NDArray[np.float32]) -> str:
    return hashlib.sha256(f32_bytes(weights)).hexdigest()


def write_probe_file(
    path: str | PathLike[str], weights: NDArray[np.float32], header: dict[str, Any],
    kind: str = "probe",
) -> Path:
    """Serialise ``weights`` and the JSON ``header`` as a safetensors file, atomically.

    ``kind`` (``probe`` or ``vector``) names the format (``dynsteer.<kind>``) and the metadata
    key of the header."""
    st = _safetensors_numpy()
    metadata = {
        "format": f"dynsteer.{kind}",
        "format_version": str(FORMAT_VERSION),
        kind: json.dumps(header, sort_keys=True, allow_nan=False, separators=(",", ":")),
        "weights_sha256": _weights_sha256(weights),
    }
    data = st.save({TENSOR_KEY: np.ascontiguousarray(weights, dtype=F32)}, metadata=metadata)
    return atomic_write_bytes(path, data)


def _read_metadata(data: bytes, where: str, kind: str) -> dict[str, Any]:
    """Parse the safetensors header by hand to give precise errors for non-probe files."""
    if len(data) < 8:
        raise ProbeFileError(
            f"{where}: not a safetensors probe file ({len(data)} bytes, too short for a header)"
        )
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise ProbeFileError(
            f"{where}: not a safetensors probe file (declared header length {n} does not fit "
            f"the {len(data)}-byte file); the file is corrupt, truncated or of another format"
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProbeFileError(
            f"{where}: not a safetensors probe file (header is not JSON: {e})"
        ) from e
    if not isinstance(header, dict):
        raise ProbeFileError(f"{where}: not a safetensors probe file (header is not an object)")
    meta = header.get("__metadata__")
    expected = f"dynsteer.{kind}"
    if not isinstance(meta, dict) or meta.get("format") != expected:
        raise ProbeFileError(
            f"{where}: a safetensors file but not a dynsteer {kind} (metadata 'format' is "
            f"{(meta or {}).get('format')!r}, expected {expected!r}); save probes with "
            "Probe.save()"
        )
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise ProbeFileError(
            f"{where}: probe file format version {version!r} is not supported (this dynsteer "
            f"reads version {FORMAT_VERSION}); upgrade dynsteer or re-export the probe"
        )
    return meta


def read_probe_file(path: str | PathLike[str],
                    kind: str = "probe") -> tuple[NDArray[np.float32], dict[str, Any]]:
    """Read a file written by :func:`write_probe_file`: (read-only weights, JSON header).

    The whole file is read once and both parts come from the same bytes, so a concurrent
    :func:`atomic_write_bytes` cannot mix old weights with a new header.
    """
    where = os.fspath(path)
    data = Path(path).read_bytes()
    meta = _read_metadata(data, where, kind)
    try:
        tensors = _safetensors_numpy().load(data)
    except Exception as e:  # safetensors raises its own (Rust) error type
        raise ProbeFileError(f"{where}: corrupt safetensors data: {e}") from e
    if set(tensors) != {TENSOR_KEY}:
        raise ProbeFileError(
            f"{where}: expected exactly one tensor {TENSOR_KEY!r}, found {sorted(tensors)}"
        )
    weights = tensors[TENSOR_KEY]
    if weights.dtype != np.float32 or weights.ndim != 1:
        raise ProbeFileError(
            f"{where}: tensor {TENSOR_KEY!r} must be 1-D float32, got {weights.dtype} "
            f"of shape {weights.shape}"
        )
    if meta.get("weights_sha256") != _weights_sha256(weights):
        raise ProbeFileError(
            f"{where}: weights checksum mismatch (the file is corrupt); re-export the probe"
        )
    try:
        header = json.loads(meta.get(kind, ""))
    except json.JSONDecodeError as e:
        raise ProbeFileError(f"{where}: {kind} metadata is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ProbeFileError(f"{where}: {kind} metadata must be a JSON object")
    weights = weights.astype(np.float32)  # native byte order, owned copy
    weights.setflags(write=False)
    return weights, header

