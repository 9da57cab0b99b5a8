"""Linear probes for dynamic steering: format, numpy reference math, sklearn conversion.

Imports numpy, pydantic and :mod:`dynsteer.controller.contract` only (safetensors when
saving/loading files, scikit-learn inside :func:`from_sklearn`); never vLLM or torch, so clients
and training scripts can use it.
"""

from dynsteer.controller.contract import HOOKS, NAME_PATTERN, NAME_RULE, Hook

from ._io import ProbeFileError
from .calibration import calibrate_threshold
from .probe import (
    ModelFingerprint,
    Probe,
    ProbeSite,
    stable_sigmoid,
)
from .sklearn_convert import from_sklearn
from .upload import upload

__all__ = [
    "HOOKS",
    "NAME_PATTERN",
    "NAME_RULE",
    "Hook",
    "ModelFingerprint",
    "Probe",
    "ProbeFileError",
    "ProbeSite",
    "calibrate_threshold",
    "from_sklearn",
    "stable_sigmoid",
    "upload",
]
