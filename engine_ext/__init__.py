"""dynsteer's vLLM side: the plugin, the in-graph ops and the Python API.

Enable it on an engine with ``LLM(..., additional_config={"dynsteer": {}})`` and steer requests
with ``SamplingParams(extra_args={"dynsteer": {"steer": [...]}})``.
"""

from dynsteer.controller.spec import SpecError, SteerEntry, SteeringSpec
from dynsteer.engine_ext.api import Steering

__all__ = ["SpecError", "SteerEntry", "Steering", "SteeringSpec"]
