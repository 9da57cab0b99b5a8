"""Request and response bodies of the ``/v1/dynsteer/`` HTTP routes.

Shared by the server (FastAPI turns them into the OpenAPI schema at ``/openapi.json``) and the
client (:mod:`dynsteer.controller.client`), so both sides agree on one contract. No vLLM import.
Vectors travel as JSON float lists or as base64 little-endian float32 (``*_b64``); never pickles.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dynsteer.probes import NAME_PATTERN, ModelFingerprint, Probe, ProbeSite
from dynsteer.probes.probe import Metadata

from .contract import decode_f32, site_name
from .spec import CaptureSpec, FiniteFloat, SteerEntry

Name = Annotated[str, Field(strict=True, pattern=f"^{NAME_PATTERN.pattern}$")]
"""Names of vectors and probes (:data:`dynsteer.probes.NAME_RULE`): safe as file names and URL
path segments, never hidden files."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VectorIn(_Body):
    """A named steering vector: ``vector`` (floats) or ``vector_b64`` (base64 float32)."""

    name: Name
    vector: list[FiniteFloat] | None = None
    vector_b64: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> VectorIn:
        if (self.vector is None) == (self.vector_b64 is None):
            raise ValueError("give exactly one of vector (float list) or vector_b64")
        return self

    def values(self) -> np.ndarray:
        if self.vector is not None:
            return np.asarray(self.vector, dtype=np.float64)
        return decode_f32("vector_b64", self.vector_b64 or "")


class VectorOut(_Body):
    name: Name
    vector: list[float]


class NameList(_Body):
    names: list[str]


class GlobalSteering(_Body):
    """Entries added to every request's steering (empty: none)."""

    steer: list[SteerEntry] = Field(default_factory=list)


class ServerInfo(_Body):
    """The served model and the plugin, as the server sees them."""

    model: str
    hidden_size: int
    num_layers: int
    sites: list[str]
    max_rows: int
    plugin_version: str
    kernel_abi: int
    vllm_version: str


class Health(_Body):
    status: str
    workers: int


class ControllerEvent(_Body):
    """One change a controller made, from ``position`` on: the gate's new ``floor`` and
    ``scale`` (``gate' = max(gate, floor) * scale``), or a switch ``action`` and its ``name``."""

    position: int
    floor: float | None = None
    scale: float | None = None
    action: str | None = None
    name: str | None = None


class ControllerReport(_Body):
    name: str
    events: list[ControllerEvent]
    """The first 64 changes, in order."""
    events_total: int
    error: str | None = None
    """Set when the controller raised and was disabled for this request."""


class GateReport(_Body):
    """Gate telemetry of one gated request (positions the engine processed)."""

    tokens_monitored: int
    gated_prefill: int
    gated_decode: int
    first_decode_gated: int | None
    first_gated: int | None = None
    """The first position (prompt or generated, from 0) whose gate was above 0.5."""
    max_score: float | None
    gates: list[float | None] | None = None
    """Per position (None where not processed); only for gates with ``"trace": true``."""
    scores: list[float | None] | None = None
    """The probe's score per position, like ``gates``."""
    controller: ControllerReport | None = None
    """What the request's controller did (None: it had none)."""


class RequestReport(_Body):
    """How a recent request was steered, and its gate telemetry when it had a gate."""

    request_id: str
    static: bool
    gated: bool
    telemetry: GateReport | None = None


class Deleted(_Body):
    deleted: str


class ProbeUpload(_Body):
    """A probe as :meth:`dynsteer.probes.Probe.to_json_dict` writes it (weights as a list or
    base64 float32); checked against the served model (hidden size, site, fingerprint)."""

    version: Literal[1] = 1
    """The probe JSON format version (only 1 exists)."""
    name: Name
    weights: list[FiniteFloat] | None = Field(default=None, min_length=1)
    weights_b64: str | None = None
    threshold: FiniteFloat = 0.0
    sharpness: Annotated[FiniteFloat, Field(gt=0)] = 1.0
    site: ProbeSite
    fingerprint: ModelFingerprint | None = None
    metadata: Metadata = Field(default_factory=dict)
    """At most 64 KiB as the probe file stores it (see :data:`dynsteer.probes.probe.Metadata`),
    so that an accepted probe also loads from the probe store after a restart."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ProbeUpload:
        if (self.weights is None) == (self.weights_b64 is None):
            raise ValueError("give exactly one of weights (float list) or weights_b64")
        return self

    def to_probe(self) -> Probe:
        """The :class:`Probe` (ValueError naming the problem, e.g. both or no weights)."""
        try:
            return Probe.from_json_dict(self.model_dump(exclude_none=True))
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            field = ".".join(str(p) for p in first["loc"]) or "probe"
            raise ValueError(f"{field}: {first['msg'].removeprefix('Value error, ')}") from None


LISTED_METADATA_BYTES = 2048
"""Largest probe metadata (bytes as stored, :attr:`Probe.metadata_bytes`) a
:class:`ProbeSummary` carries: the probe listing is public and lists every probe, so it stays
small; ``GET /v1/dynsteer/probes/{name}`` returns any metadata whole."""


class ProbeSummary(_Body):
    name: str
    site: str
    threshold: float
    sharpness: float
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The probe's metadata; empty when it is larger than :data:`LISTED_METADATA_BYTES`."""
    metadata_omitted: bool = False
    """Whether ``metadata`` was left out for its size (read the probe itself for it)."""

    @classmethod
    def of(cls, probe: Probe) -> ProbeSummary:
        """The summary of ``probe``, its metadata left out when large."""
        omitted = probe.metadata_bytes > LISTED_METADATA_BYTES
        return cls(name=probe.name, site=site_name((probe.site.hook, probe.site.layer)),
                   threshold=probe.threshold, sharpness=probe.sharpness,
                   metadata={} if omitted else dict(probe.metadata), metadata_omitted=omitted)


class ProbeList(_Body):
    probes: list[ProbeSummary]


class CapturedArray(_Body):
    """One captured float32 array (base64 little-endian), as ``/v1/dynsteer/capture`` returns."""

    dtype: str
    shape: list[int]
    data: str

    def to_numpy(self) -> np.ndarray:
        return decode_f32("data", self.data).reshape(self.shape)


CaptureResponse = dict[str, CapturedArray | list[CapturedArray]]
"""Per site (``hook@layer``): one ``[N, H]`` array (``last``/``mean``) or one ``[len_i, H]``
array per prompt (``all``)."""


class GlobalCapture(_Body):
    """The capture the server adds to every completion that asks for none
    (``/v1/dynsteer/capture/global``); None: off."""

    capture: CaptureSpec | None = None
    session: str | None = None
    """Only requests of this session (as the server names it: ``<key namespace><name>`` with
    API keys configured); None: every session and none."""
    caller: str | None = None
    """Only requests authenticated by the API key of this namespace (``-/``: requests without
    a configured key); None: every caller."""
