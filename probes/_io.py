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
probe would steer the wrong tokens. Whoever stores a file may add string entries of its own
beside these (``extra``, e.g. the server's registration order), which are not part of the
probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from dynsteer.controller.contract import F32, f32_bytes

FORMAT_VERSION = 1
TENSOR_KEY = "weights"
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Largest safetensors header the loader reads (a longer one is refused before allocating).
A probe's header is a few hundred bytes plus its metadata, which :data:`MAX_METADATA_BYTES`
bounds so that every probe that can be saved stays far below this."""
MAX_METADATA_BYTES = 64 * 1024
"""Largest metadata of a probe, in bytes of its JSON as the file stores it (:func:`json_size`):
bytes, not characters, since the file escapes a non-ASCII character as ``\\uXXXX`` (6 bytes,
12 beyond the BMP). The safetensors header escapes that JSON once more, at most doubling it, so
a probe of this much metadata has a header of well under 1 MiB: anything :meth:`Probe.save
<dynsteer.probes.Probe.save>` accepts loads again."""


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


def _stored_json(value: Any) -> str:
    """``value`` as JSON the way files store it: ASCII only, sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))


def json_size(value: Any) -> int:
    """Bytes ``value`` takes in a file's JSON header (what :data:`MAX_METADATA_BYTES` limits)."""
    return len(_stored_json(value))


class ProbeFile(NamedTuple):
    """What :func:`read_probe_file` reads."""

    weights: NDArray[np.float32]
    """Read-only float32 weights."""
    header: dict[str, Any]
    """The JSON header: a probe's fields or a vector's name."""
    extra: dict[str, str]
    """The ``extra`` string entries stored beside it (see :func:`write_probe_file`)."""


def _format_keys(kind: str) -> frozenset[str]:
    return frozenset({"format", "format_version", kind, "weights_sha256"})


def write_probe_file(
    path: str | PathLike[str], weights: NDArray[np.float32], header: dict[str, Any],
    kind: str = "probe", extra: Mapping[str, str] | None = None,
) -> Path:
    """Serialise ``weights`` and the JSON ``header`` as a safetensors file, atomically.

    ``kind`` (``probe`` or ``vector``) names the format (``dynsteer.<kind>``) and the metadata
    key of the header. ``extra``: string entries of the caller's own, stored beside the format's
    (whose keys they must not reuse) and read back as :attr:`ProbeFile.extra`."""
    extra = dict(extra or {})
    taken = _format_keys(kind) & set(extra)
    if taken:
        raise ValueError(f"extra: {sorted(taken)} are keys of the file format; use other keys")
    st = _safetensors_numpy()
    metadata = {
        **extra,
        "format": f"dynsteer.{kind}",
        "format_version": str(FORMAT_VERSION),
        kind: _stored_json(header),
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
    if n > MAX_HEADER_BYTES:
        raise ProbeFileError(
            f"{where}: not a safetensors probe file this loader reads: its declared header "
            f"length, {n} bytes, is larger than the {MAX_HEADER_BYTES >> 20} MiB limit; the "
            "file is corrupt, of another format, or holds far more metadata than Probe.save() "
            "accepts"
        )
    if 8 + n > len(data):
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


def read_probe_file(path: str | PathLike[str], kind: str = "probe") -> ProbeFile:
    """Read a file written by :func:`write_probe_file`.

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
    extra = {k: v for k, v in meta.items() if k not in _format_keys(kind)}
    return ProbeFile(weights, header, extra)

