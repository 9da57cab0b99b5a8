"""The probe: one linear read-out of one residual-stream site, plus a soft threshold.

A probe scores a hidden state ``x`` (shape ``(..., hidden_size)``) as ``x @ weights`` and turns the
margin over ``threshold`` into a gate in ``(0, 1)`` with a logistic of slope ``sharpness``. The
engine uses the gate to decide how strongly to steer a token; everything here is the numpy
reference of that computation, so it must stay free of vLLM and torch (clients, the HTTP layer and
training scripts import it).

Weights are float32 because that is what the engine multiplies with (and what goes over the wire);
scores accumulate in float64 so the numpy reference is not noisier than the data. The threshold is
kept as a float64 Python ``float`` because it absorbs folded intercepts (see
:mod:`dynsteer.probes.sklearn_convert`) whose magnitude can be large.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from dynsteer.controller.contract import (
    NAME_PATTERN,
    NAME_RULE,
    Hook,
    decode_f32,
    encode_f32,
)

from . import _io

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MetadataValue = str | bool | int | FiniteFloat
"""Metadata values are JSON scalars (no NaN/inf, which JSON cannot carry)."""


def _check_metadata_size(metadata: dict[str, MetadataValue]) -> dict[str, MetadataValue]:
    """Metadata fits the probe file's header (so a probe that was accepted loads again)."""
    size = _io.json_size(metadata)
    if size > _io.MAX_METADATA_BYTES:
        raise ValueError(
            f"{size} bytes as stored (JSON, non-ASCII characters escaped), more than the "
            f"{_io.MAX_METADATA_BYTES}-byte limit; keep metadata to short provenance and store "
            "bulky data elsewhere"
        )
    return metadata


Metadata = Annotated[dict[str, MetadataValue], AfterValidator(_check_metadata_size)]
"""A probe's metadata: JSON scalars by key, at most :data:`~._io.MAX_METADATA_BYTES` stored."""


class ProbeSite(BaseModel):
    """Where in the model a probe reads the residual stream."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer: int = Field(ge=0)
    """Decoder layer, 0-based."""
    hook: Hook = "post_block"
    """Which residual stream of the layer: before attention, after attention or after the MLP."""


class ModelFingerprint(BaseModel):
    """What identifies the residual-stream basis a probe was trained in.

    Two models with the same hidden size but different architectures (or checkpoints of different
    depth) do not share a basis, so loading a probe into the wrong one must fail loudly rather
    than produce plausible-looking garbage gates.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str = Field(min_length=1, max_length=256)
    """Hugging Face architecture name, e.g. ``"LlamaForCausalLM"`` (``config.architectures``)."""
    hidden_size: int = Field(gt=0)
    """Width of the residual stream; must equal the probe's number of weights."""
    num_layers: int = Field(gt=0)
    """Number of decoder layers; the probe's layer must be below it."""

    def describe(self) -> str:
        """One-line description used in error messages."""
        return f"{self.architecture} (hidden_size={self.hidden_size}, num_layers={self.num_layers})"

    def mismatches(self, model: ModelFingerprint) -> list[str]:
        """Human-readable differences between this (trained-on) fingerprint and ``model``."""
        out = []
        for field in ("architecture", "hidden_size", "num_layers"):
            mine, theirs = getattr(self, field), getattr(model, field)
            if mine != theirs:
                out.append(f"{field}: probe was trained on {mine!r}, model has {theirs!r}")
        return out

    def check_matches(self, model: ModelFingerprint) -> None:
        """Raise ``ValueError`` naming both values if ``model`` is not this fingerprint."""
        problems = self.mismatches(model)
        if problems:
            raise ValueError(
                f"model fingerprint mismatch: trained on {self.describe()}, "
                f"model is {model.describe()}: " + "; ".join(problems)
            )


class Probe(BaseModel):
    """A linear probe: ``gate(x) = sigmoid(sharpness * (x @ weights - threshold))``.

    Immutable (the engine shares one instance across requests and threads); use :meth:`replace`
    to derive a modified copy. ``weights`` is a read-only float32 array owned by the probe.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str
    """Registry name (:data:`NAME_RULE`); used in file names, URLs and metric labels."""
    weights: np.ndarray
    """The direction ``w``, float32 of shape ``(hidden_size,)``; finite and non-empty."""
    threshold: FiniteFloat = 0.0
    """Score at which the gate is 0.5; ``decision_function(x) = x @ w - threshold``."""
    sharpness: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    """Slope of the logistic gate; 1.0 makes the gate a logistic-regression probability."""
    site: ProbeSite
    """The layer and hook whose residual stream the probe reads."""
    fingerprint: ModelFingerprint | None = None
    """The model the probe was trained on, if known; checked by :meth:`check_compatible`."""
    metadata: Metadata = Field(default_factory=dict)
    """Free-form provenance (training data, source estimator, calibration); JSON scalars only,
    at most 64 KiB as stored (:data:`~._io.MAX_METADATA_BYTES`)."""

    # --- validation -------------------------------------------------------------------------

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not NAME_PATTERN.fullmatch(value):
            raise ValueError(
                f"probe name {value!r} is invalid: use {NAME_RULE}"
            )
        return value

    @field_validator("weights", mode="before")
    @classmethod
    def _coerce_weights(cls, value: Any) -> NDArray[np.float32]:
        return _as_weights(value)

    @model_validator(mode="after")
    def _check_fingerprint(self) -> Probe:
        fp = self.fingerprint
        if fp is not None:
            if fp.hidden_size != self.hidden_size:
                raise ValueError(
                    f"weights have {self.hidden_size} entries but fingerprint.hidden_size is "
                    f"{fp.hidden_size}"
                )
            if self.site.layer >= fp.num_layers:
                raise ValueError(
                    f"site.layer {self.site.layer} is out of range for fingerprint.num_layers "
                    f"{fp.num_layers}"
                )
        return self

    # pydantic's generated __eq__ compares fields with ``==``, which is ambiguous for arrays.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Probe):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, f), getattr(other, f))
            if f == "weights"
            else getattr(self, f) == getattr(other, f)
            for f in type(self).model_fields
        )

    __hash__ = None  # type: ignore[assignment]  # weights and metadata are not hashable

    # --- basic properties -------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Number of weights (the residual-stream width the probe expects)."""
        return int(self.weights.shape[0])

    @property
    def metadata_bytes(self) -> int:
        """Size of :attr:`metadata` as the file stores it (what its limit counts)."""
        return _io.json_size(self.metadata)

    def replace(self, **changes: Any) -> Probe:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        fields = {f: getattr(self, f) for f in type(self).model_fields}
        fields.update(changes)
        return type(self).model_validate(fields)

    def incompatibilities(self, model: ModelFingerprint) -> list[str]:
        """Why this probe cannot be applied to ``model`` (empty: it can), each problem starting
        with the field at fault and naming the probe's and the model's values.

        Hidden size and layer range are always checked; the architecture only when the probe
        carries a fingerprint (whose own hidden size is the weights', see the validator).
        """
        fp = self.fingerprint
        problems = [f"fingerprint: {p}" for p in fp.mismatches(model)] if fp is not None else []
        if self.hidden_size != model.hidden_size and fp is None:
            problems.append(f"weights: probe has {self.hidden_size} weights, model has "
                            f"{model.hidden_size} (its hidden_size)")
        if self.site.layer >= model.num_layers:
            problems.append(f"site.layer: {self.site.layer} does not exist (the model has "
                            f"{model.num_layers} layers)")
        return problems

    def check_compatible(self, model: ModelFingerprint) -> None:
        """Raise ``ValueError`` naming the probe and :meth:`incompatibilities` if this probe
        cannot be applied to ``model``."""
        problems = self.incompatibilities(model)
        if problems:
            fp = self.fingerprint
            trained = f" (trained on {fp.describe()})" if fp is not None else ""
            raise ValueError(
                f"probe {self.name!r}{trained} does not fit model {model.describe()}: "
                + "; ".join(problems)
            )

    # --- numerics ---------------------------------------------------------------------------

    def _features(self, X: ArrayLike) -> NDArray[np.float64]:
        x = np.asarray(X, dtype=np.float64)
        if x.ndim == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"probe {self.name!r} expects inputs of shape (..., {self.hidden_size}), "
                f"got {x.shape}"
            )
        return x

    def score(self, X: ArrayLike) -> NDArray[np.float64]:
        """``X @ weights`` accumulated in float64; shape ``X.shape[:-1]``."""
        return self._features(X) @ self.weights.astype(np.float64)

    def decision_function(self, X: ArrayLike) -> NDArray[np.float64]:
        """``X @ weights - threshold``: positive where the probe fires (gate > 0.5)."""
        return self.score(X) - self.threshold

    def gate(self, X: ArrayLike) -> NDArray[np.float64]:
        """``sigmoid(sharpness * decision_function(X))``, stable for any finite input."""
        with np.errstate(over="ignore"):  # a product beyond float64 range is +-inf: gate 1 or 0
            z = self.sharpness * self.decision_function(X)
        return stable_sigmoid(z)

    # --- serialisation ----------------------------------------------------------------------

    def _header(self) -> dict[str, Any]:
        """Every field but the weights, as JSON-ready values, plus the format version."""
        return {"version": _io.FORMAT_VERSION, **self.model_dump(mode="json", exclude={"weights"})}

    @classmethod
    def _from_header(cls, header: Mapping[str, Any], weights: NDArray[np.float32]) -> Probe:
        fields = dict(header)
        version = fields.pop("version", _io.FORMAT_VERSION)
        if version != _io.FORMAT_VERSION:
            raise ValueError(
                f"probe format version {version!r} is not supported (this dynsteer reads "
                f"version {_io.FORMAT_VERSION}); upgrade dynsteer or re-export the probe"
            )
        if "weights" in fields:
            raise ValueError("probe header must not contain 'weights'")
        return cls.model_validate({**fields, "weights": weights})

    def save(self, path: str | PathLike[str], *, extra: Mapping[str, str] | None = None) -> Path:
        """Write the probe as one safetensors file, atomically; returns the path.

        The file holds one float32 tensor ``weights`` and, in the string metadata, the other fields
        as JSON plus a SHA-256 of the weights. No pickle is involved. Readers never see a partial
        file: it is written to a temporary file in the same directory, fsynced and renamed.
        What is saved loads again: metadata beyond the loader's header limit cannot be in a
        probe (see :data:`Metadata`). ``extra``: string entries of the caller's own stored
        beside the probe (not part of it; e.g. a server's registration order), which
        :meth:`read` returns.
        """
        return _io.write_probe_file(path, self.weights, self._header(), extra=extra)

    @classmethod
    def load(cls, path: str | PathLike[str]) -> Probe:
        """Read a file written by :meth:`save`; ``ValueError`` if it is not a valid probe file."""
        return cls.read(path)[0]

    @classmethod
    def read(cls, path: str | PathLike[str]) -> tuple[Probe, dict[str, str]]:
        """:meth:`load`, plus the ``extra`` entries :meth:`save` stored beside the probe."""
        file = _io.read_probe_file(path)
        try:
            return cls._from_header(file.header, file.weights), file.extra
        except ValueError as e:
            raise _io.ProbeFileError(f"{path}: not a valid dynsteer probe: {e}") from e

    def to_json_dict(self, *, weights_format: Literal["b64", "list"] = "b64") -> dict[str, Any]:
        """A JSON-serialisable dict (for HTTP); weights as base64 little-endian float32 by default.

        ``weights_format="list"`` emits a plain ``weights`` list of floats instead (readable, about
        4x larger). Either form round-trips bit-exactly through :meth:`from_json_dict`.
        """
        out = self._header()
        if weights_format == "b64":
            out["weights_b64"] = encode_f32(self.weights)
        elif weights_format == "list":
            out["weights"] = [float(v) for v in self.weights]
        else:
            raise ValueError(f"weights_format must be 'b64' or 'list', got {weights_format!r}")
        return out

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> Probe:
        """Inverse of :meth:`to_json_dict`; exactly one of ``weights_b64`` / ``weights`` is given.

        Unknown keys are rejected (a typo must not silently drop a field).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"probe JSON must be an object, got {type(data).__name__}")
        fields = dict(data)
        has_b64, has_list = "weights_b64" in fields, "weights" in fields
        if has_b64 == has_list:
            raise ValueError(
                "probe JSON must contain exactly one of 'weights_b64' (base64 little-endian "
                "float32) or 'weights' (list of floats)"
            )
        if has_b64:
            weights = decode_f32("weights_b64", fields.pop("weights_b64"))
        else:
            raw = fields.pop("weights")
            if not isinstance(raw, list) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in raw
            ):
                raise ValueError("'weights' must be a list of numbers")
            weights = _as_weights(raw)
        return cls._from_header(fields, weights)


def _as_weights(value: Any) -> NDArray[np.float32]:
    """Validate and copy ``value`` into a read-only float32 vector."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"weights must be a 1-D array of numbers: {e}") from e
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"weights must be real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"weights must be 1-D (hidden_size,), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("weights must not be empty")
    with np.errstate(over="ignore"):
        weights = arr.astype(np.float32)  # always a copy: the caller's array may change later
    finite = np.isfinite(weights)
    if not finite.all():
        i = int(np.argmin(finite))
        reason = " (overflows float32)" if np.isfinite(arr[i]) else ""
        raise ValueError(f"weights must be finite; weights[{i}] = {arr[i].item()!r}{reason}")
    weights.setflags(write=False)
    return weights


def stable_sigmoid(z: ArrayLike) -> NDArray[np.float64]:
    """Logistic function without overflow: only ``exp(-|z|)`` (in ``(0, 1]``) is evaluated.

    ``1 / (1 + exp(-z))`` overflows for very negative ``z`` and warns; this form saturates to
    exactly 0.0 or 1.0 instead. NaN stays NaN. Scalars in, numpy scalar out.
    """
    z = np.asarray(z, dtype=np.float64)
    with np.errstate(under="ignore"):
        e = np.exp(-np.abs(z))
    out = np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return out[()]
