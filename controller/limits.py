"""Numeric limits of everything that reaches a kernel, checked in one place.

Steering rows and probes live in float32 tables on the device and the steered stream is cast to
the model's dtype, so a number that is a fine Python float (``1e39``) can still be ``inf`` where
it is used, and a finite but huge vector (``1e20 * 1e20``) overflows the next layer's norm. Such
a value would not only break its own request: non-finite activations end up in KV blocks that
are later reused by other requests. Every way a number enters dynsteer (per-request specs,
global steering, registered vectors, probes, inline or uploaded) goes through these checks, so
the same value gets the same HTTP 400 with the field named wherever it is sent:

* every float is a JSON/Python number (no strings, no booleans) and finite **in float32**;
* a steering entry's effective vector ``scale * vector`` is finite in the model's dtype and its
  L2 norm is at most ``max_steer_norm`` (an engine option, :data:`DEFAULT_MAX_STEER_NORM`);
* probe weights, thresholds and sharpness are at most :data:`PROBE_MAX_ABS` in magnitude.

The in-graph op adds a last line of defence (:data:`STREAM_ABS_LIMIT`): see
``dynsteer.engine_ext.worker.ops``. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import Field, TypeAdapter, ValidationError

from .contract import SpecError

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Largest finite float32; steering tables and probe math are float32."""

DEFAULT_MAX_STEER_NORM = 1e4
"""Default bound on ``‖scale · vector‖`` (L2) of one steering entry. Residual streams of the
models dynsteer serves have norms of tens to a few thousands (outlier tokens); 1e4 leaves room
for strong steering and keeps every element far from overflow in fp16, bf16 and fp32."""

PROBE_MAX_ABS = 1e6
"""Bound on the magnitude of every probe weight, threshold and sharpness."""

STREAM_ABS_LIMIT = 1e15
"""The op never writes a steered element whose magnitude exceeds this (or the model dtype's
largest finite value, whichever is smaller), nor a NaN: such an element keeps its unsteered
value. ``H * 1e30`` stays finite in float32 for any hidden size below 3e8, so the next layer's
norm cannot overflow because of steering."""

FiniteFloat = Annotated[
    float, Field(strict=True, allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)
]
"""A JSON number (int or float, never a string or a boolean) that is finite in float32."""

_FLOAT_LIST = TypeAdapter(list[FiniteFloat])

def float_error_message(error: dict[str, Any]) -> str:
    """pydantic's message for one float, reworded when it is the float32 range."""
    ctx = error.get("ctx") or {}
    if ctx.get("le") == FLOAT32_MAX or ctx.get("ge") == -FLOAT32_MAX:
        return f"{error['input']!r} is not finite in float32 (|x| at most {FLOAT32_MAX:.6g})"
    return str(error["msg"])

def as_float32_vector(field: str, values: Sequence[float] | np.ndarray, length: int) -> np.ndarray:
    """``values`` as a finite float32 vector of ``length``, or a :class:`SpecError`.

    Lists are checked element by element as JSON numbers (vectorized in pydantic's core);
    arrays must have a numeric dtype (booleans and strings are refused, as in JSON bodies).
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "fiu":
            raise SpecError(f"{field}: expected numbers, got an array of {values.dtype}")
        array = values
    else:
        try:
            array = np.asarray(_FLOAT_LIST.validate_python(list(values)), dtype=np.float64)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = "".join(f"[{p}]" for p in first["loc"])
            raise SpecError(f"{field}{where}: {float_error_message(first)}") from None
        except TypeError as e:
            raise SpecError(f"{field}: expected a list of {length} numbers ({e})") from None
    if array.shape != (length,):
        raise SpecError(
            f"{field}: expected {length} floats (the model's hidden size), got shape {array.shape}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        out = array.astype(np.float32)
    if not np.isfinite(out).all():
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise SpecError(f"{field}[{bad}]: {float(array[bad])!r} is not finite in float32")
    return out

def check_steer_magnitude(field: str, norm: float, scale: float, max_norm: float,
                          dtype_max: float) -> None:
    """``scale * vector``, with ``norm`` the vector's L2 norm, is usable: its norm is at most
    ``max_norm`` and (so every element is) at most the model dtype's largest finite value."""
    effective = abs(scale) * norm
    if not effective <= max_norm:
        raise SpecError(
            f"{field}: ‖scale · vector‖ = {effective:.4g} exceeds the engine's max_steer_norm "
            f"{max_norm:.4g}; use a smaller scale or vector (or raise dynsteer.max_steer_norm)"
        )
    if not effective <= dtype_max:
        raise SpecError(f"{field}: ‖scale · vector‖ = {effective:.4g} overflows the model's "
                         f"dtype (largest finite value {dtype_max:.4g})")

def check_probe_numbers(prefix: str, threshold: float, sharpness: float,
                        weights: np.ndarray | None = None) -> None:
    """Probe numbers within :data:`PROBE_MAX_ABS` (``weights`` already float32-checked)."""
    if weights is not None and weights.size and float(np.abs(weights).max()) > PROBE_MAX_ABS:
        raise SpecError(f"{prefix}weights: magnitudes must be at most {PROBE_MAX_ABS:.0e}")
    if not abs(threshold) <= PROBE_MAX_ABS:
        raise SpecError(f"{prefix}threshold: must be finite and at most {PROBE_MAX_ABS:.0e} "
                        "in magnitude")
    if not 0 < sharpness <= PROBE_MAX_ABS:
        raise SpecError(f"{prefix}sharpness: must be > 0 and at most {PROBE_MAX_ABS:.0e}")
