"""The registry census (``engine_ext/compat/census.py``): every text-generation class of the
installed vLLM is in exactly one group, the verified classes are recognized on every path and
have a reference test, the documented table is the census, and the layouts that a reading by
signature gets wrong are read right (no engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dynsteer.engine_ext.compat.census import (
    VERIFIED,
    census,
    class_norms,
    registry,
    render,
)
from dynsteer.engine_ext.compat.layer_contract import Refused, analyze, layer_contract

DOC = Path(__file__).resolve().parents[1] / "docs/architectures.md"


@pytest.fixture(scope="module")
def rows():
    return census()


def test_every_registry_class_is_in_exactly_one_group(rows):
    names = [r.architecture for r in rows]
    assert sorted(names) == sorted(registry()) and len(set(names)) == len(names)
    assert {r.group for r in rows} <= {"verified", "contract", "depends", "refused"}
    assert all(r.why for r in rows if r.group in ("depends", "refused"))
    assert all(r.kinds and r.hooks for r in rows if r.group != "refused")


def test_verified_classes_are_recognized_and_tested(rows):
    """A class is verified only where the census recognizes it on every path and its tiny test
    model is one the HF reference tests run."""
    from test_architectures import ARCHS
    from tiny_models import ARCHITECTURES

    groups = {r.architecture: r.group for r in rows}
    for arch, model in VERIFIED.items():
        assert groups[arch] == "verified", arch
        assert model in ARCHITECTURES
        assert model in ARCHS or model in ("llama", "qwen2", "qwen3"), model


def test_the_documented_table_is_the_census(rows):
    text = DOC.read_text()
    table = re.search(r"<!-- census:begin -->\n(.*)\n<!-- census:end -->", text, re.S)
    assert table is not None and table.group(1) == render(rows), (
        "docs/architectures.md is out of date: "
        "python -m dynsteer.engine_ext.compat.census")


def _layer(module: str, name: str) -> type:
    import importlib

    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


def test_layers_that_take_a_residual_they_do_not_use_are_read_by_their_code():
    """Cohere's norm passes the residual through: its layer is parallel attention + MLP (no
    post_attn); MiniCPM and Exaone 4 overwrite theirs: one stream, not a pair."""
    cohere = _layer("commandr", "CohereDecoderLayer")
    contract = layer_contract(cohere, norm_of=class_norms(cohere))
    assert (contract.kind, contract.mid, contract.split_input) == (
        "parallel attention + MLP", None, False)
    for module, name, mid in (("minicpm", "MiniCPMDecoderLayer", "post_attention_layernorm"),
                              ("exaone4", "Exaone4DecoderLayer", "mlp")):
        cls = _layer(module, name)
        contract = layer_contract(cls, norm_of=class_norms(cls))
        assert (contract.split_input, contract.output, contract.mid) == (False, "first", mid)
    llama = _layer("llama", "LlamaDecoderLayer")
    contract = layer_contract(llama, norm_of=class_norms(llama))
    assert (contract.split_input, contract.output, contract.mid, contract.mid_fused,
            contract.entry_norm) == (True, "split", "post_attention_layernorm", True,
                                     "input_layernorm")


def test_a_stream_rescaled_in_float16_is_refused_in_float16_only():
    deepseek = _layer("deepseek_v2", "DeepseekV2DecoderLayer")
    norms = class_norms(deepseek)
    assumed = {"self.use_sequence_parallel_moe": False, "self.use_mha": False,
               "isinstance(self.self_attn, DeepseekAttention)": False, "self.layer_idx == 0": True}
    for dtype, refused in ((torch.float16, True), (torch.bfloat16, False)):
        outcomes = [c for a, c in analyze(deepseek, dtype=dtype, norm_of=norms)
                    if all(a.get(k, v) == v for k, v in assumed.items())]
        assert outcomes and all(isinstance(c, Refused) == refused for c in outcomes)
        if refused:
            assert "the stream is scaled" in str(outcomes[0])


def test_transformers_backend_classes_are_read_from_hf_layers(rows):
    """Classes vLLM serves through its Transformers backend run HF's own decoder layers: the
    census reads those (the model's first ``_no_split_modules`` class)."""
    by_name = {r.architecture: r for r in rows}
    olmo3 = by_name["Olmo3ForCausalLM"]
    assert olmo3.layers == ("Olmo3DecoderLayer",) and olmo3.kinds == ("one stream",)
    neox = by_name["GPTNeoXForCausalLM"]
    assert neox.layers == ("GPTNeoXLayer",)
    assert set(neox.kinds) == {"one stream", "parallel attention + MLP"}  # by configuration
    assert neox.hooks == ("pre_attn", "post_block")
    assert by_name["PhiForCausalLM"].hooks == ("pre_attn", "post_block")
