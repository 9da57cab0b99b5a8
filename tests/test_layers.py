"""Site installation on module trees (no engine)."""

from __future__ import annotations

import pytest
from torch import nn

from dynsteer.engine_ext.compat.model import SUPPORTED_ARCHITECTURES, arch_spec_for


def test_unsupported_architecture_names_the_model_class():
    """An architecture whose layer contract is not verified fails at startup, by name."""
    gemma = type("Gemma3ForCausalLM", (nn.Module,), {})()
    with pytest.raises(RuntimeError, match="does not support the model class Gemma3ForCausalLM"):
        arch_spec_for(gemma)


def test_verified_architectures():
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        SUPPORTED_ARCHITECTURES)
