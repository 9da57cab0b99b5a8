"""vLLM's decoder-layer contracts: where the residual stream is and how a site is wrapped in.

Two contracts cover the supported architectures; which one a layer follows is read from its
``forward`` signature when the sites are installed:

* *split stream* (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, Qwen3-MoE, Mixtral, GPT-OSS):
  layers take ``(positions, hidden_states, residual)`` (GPT-OSS: ``(hidden_states, positions,
  residual)``) and return ``(hidden_states, residual)``; the stream after a layer is
  ``hidden_states + residual`` and layer 0 receives ``residual=None``. vLLM fuses the
  residual adds into the norms, so the stream after attention first exists inside
  the norm that receives ``(attn_out, residual)``: Llama's ``post_attention_layernorm``,
  Gemma's ``pre_feedforward_layernorm`` (Gemma's ``post_attention_layernorm`` normalizes the
  attention output *before* the add, so it is not a stream site);
* *single stream* (Granite): layers take ``(positions, hidden_states)`` and return the stream;
  the attention output is added as ``residual + attn_out * residual_multiplier`` in the layer
  body, and that sum is both the input of ``post_attention_layernorm`` and the residual the
  MLP output is added to.

A site's module ``op(x, h=None)`` returns ``x`` steered, reading the stream ``x + h``:

* ``pre_attn``  (TransformerLens ``resid_pre``): wrapper around the layer, before it; it steers
  ``residual`` (``hidden_states`` at layer 0's entry and in single-stream layers);
* ``post_attn`` (``resid_mid``): wrapper around the architecture's mid-stream norm; split
  stream: its residual input is steered; single stream: its input is steered *in place*, so
  the layer's ``residual`` variable (the same tensor) carries the steering into the MLP's add
  too (torch.compile's functionalization keeps the aliasing);
* ``post_block`` (``resid_post``): split stream: inside the next layer's input norm (the
  model's final norm after the last layer), which adds the layer's two halves, where that is
  vLLM's RMSNorm and the next layer is this stage's and has no ``pre_attn`` site (see
  :func:`wrap_sites`); otherwise, and in single-stream layers, a wrapper around the layer,
  after it.

Layers and norms are wrapped (not hooked), so torch.compile traces the ops into the graph.
What each hook means per architecture, in terms of HF transformers' residual stream, is the
README's architecture table; ``tests/hf_reference.py`` checks it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """How to reach the sites of one model class (verified against HF transformers)."""

    mid_norm: str = "post_attention_layernorm"
    """The norm that reads the residual stream right after attention's residual add."""


_GEMMA = ArchSpec(mid_norm="pre_feedforward_layernorm")

SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(),
    "Qwen3ForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(),
    "Phi3ForCausalLM": ArchSpec(),
    "GraniteForCausalLM": ArchSpec(),
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "Qwen3MoeForCausalLM": ArchSpec(),
    "MixtralForCausalLM": ArchSpec(),
    "GptOssForCausalLM": ArchSpec(),
}
"""Architectures whose layer contract is checked by tests against HF transformers
(``tests/test_architectures.py``); only these are accepted."""


def splits_stream(layer: nn.Module) -> bool:
    """Whether ``layer`` follows the split-stream contract (it takes a ``residual``)."""
    return "residual" in inspect.signature(layer.forward).parameters


class _LayerWrapper(nn.Module):
    """A decoder layer with optional ``pre_attn`` / ``post_block`` sites around it.

    Attributes the wrapper does not have are read from the layer, so model code that reaches
    into its layers (GPT-OSS reads ``layers[i].mlp.experts``) sees the layer it wrapped.
    """

    def __init__(self, layer: nn.Module, pre: nn.Module | None, post: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.pre = pre
        self.post = post

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class SteeredLayer(_LayerWrapper):
    """A split-stream layer. Most take ``(positions, hidden_states, residual)``; GPT-OSS takes
    ``(hidden_states, positions, residual)``: the order is read from the layer's signature."""

    def __init__(self, layer: nn.Module, pre: nn.Module | None, post: nn.Module | None) -> None:
        super().__init__(layer, pre, post)
        names = list(inspect.signature(layer.forward).parameters)
        self.stream_first = names.index("hidden_states") < names.index("positions")

    def forward(self, first, second, residual, **kwargs):
        positions, hidden_states = (second, first) if self.stream_first else (first, second)
        if self.pre is not None:
            if residual is None:
                hidden_states = self.pre(hidden_states)
            else:
                residual = self.pre(residual, hidden_states)
        args = (hidden_states, positions) if self.stream_first else (positions, hidden_states)
        hidden_states, residual = self.layer(*args, residual, **kwargs)
        if self.post is not None:
            residual = self.post(residual, hidden_states)
        return hidden_states, residual


class SteeredStreamLayer(_LayerWrapper):
    """A single-stream layer: ``(positions, hidden_states)`` in, the stream out."""

    def forward(self, positions, hidden_states, **kwargs):
        if self.pre is not None:
            hidden_states = self.pre(hidden_states)
        hidden_states = self.layer(positions, hidden_states, **kwargs)
        return hidden_states if self.post is None else self.post(hidden_states)


def fusable_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is vLLM's plain weighted RMSNorm, whose fused add + norm
    ``dynsteer::steer_norm`` computes in the site's kernel (Gemma's ``1 + weight`` norm, a
    norm without weight or over part of the row are not)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and norm.has_weight and norm.pass_weight_add
            and norm.variance_size_override is None)


class SteeredNorm(nn.Module):
    """A fused add+norm whose residual input is steered first: split stream's ``post_attn``,
    and ``post_block`` moved into the next layer's input norm (see :func:`wrap_sites`).

    Where the site can (:meth:`.SiteOp.fuses_norm`: on CUDA) and the norm is vLLM's plain
    RMSNorm, the site and the norm run as one op (``dynsteer::steer_norm``, one kernel),
    with the norm's weight and epsilon; elsewhere the site runs, then the norm."""

    def __init__(self, norm: nn.Module, site: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.site = site
        self.fusable = fusable_norm(norm) and hasattr(site, "fuses_norm")

    def forward(self, x, residual=None):
        if residual is None:
            raise RuntimeError("dynsteer: a steered norm expects to receive a residual")
        if self.fusable and self.site.fuses_norm(residual):
            return self.site.steer_norm(residual, x, self.norm.weight,
                                        self.norm.variance_epsilon)
        return self.norm(x, self.site(residual, x))


class SteeredStreamNorm(nn.Module):
    """A norm whose input, the whole stream, is steered in place first (single stream's
    ``post_attn``): the layer keeps the same tensor as the residual of its MLP add."""

    def __init__(self, norm: nn.Module, site: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.site = site

    def forward(self, x):
        x.copy_(self.site(x))
        return self.norm(x)


def arch_spec_for(model: nn.Module) -> ArchSpec:
    """The site map of a model, or a startup error naming the unsupported class."""
    name = type(model).__name__
    spec = SUPPORTED_ARCHITECTURES.get(name)
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise RuntimeError(
            f"dynsteer does not support the model class {name} (supported: {supported}); "
            "start the engine without additional_config['dynsteer'] to serve it unsteered"
        )
    return spec


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers of a supported model."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise RuntimeError(
            f"dynsteer: {type(model).__name__} has no model.layers; its layer contract is unknown"
        )
    return layers


def _owned(layer: nn.Module) -> bool:
    """False for a layer another pipeline stage runs (vLLM's ``PPMissingLayer``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return not isinstance(layer, PPMissingLayer)


ENTRY_NORM = "input_layernorm"
"""The norm a split-stream layer (other than layer 0) first calls, as ``norm(hidden_states,
residual)``: the stream after the layer before exists first inside it."""


def _norm_after(model: nn.Module, layers: list[nn.Module], index: int,
                ops: dict[tuple[str, int], nn.Module]) -> tuple[nn.Module, str] | None:
    """Where a ``post_block`` site of layer ``index`` can run inside the norm that adds its
    stream: ``(module, attribute)`` of the next layer's input norm (the model's final norm
    after the last layer), or None. None where the next layer belongs to another pipeline
    stage, has a ``pre_attn`` site (that site steers the same stream after this one), or
    either layer is not split-stream or the norm is not vLLM's plain RMSNorm."""
    if not splits_stream(layers[index]):
        return None
    if index + 1 < len(layers):
        nxt = layers[index + 1]
        if (not _owned(nxt) or ("pre_attn", index + 1) in ops or not splits_stream(nxt)
                or not fusable_norm(getattr(nxt, ENTRY_NORM, None))):
            return None
        return nxt, ENTRY_NORM
    inner = getattr(model, "model", None)
    return (inner, "norm") if fusable_norm(getattr(inner, "norm", None)) else None


def wrap_sites(model: nn.Module, ops: dict[tuple[str, int], nn.Module]) -> list[tuple[str, int]]:
    """Put each ``(hook, layer)`` op into the model; returns the sites installed here (sites
    on layers another pipeline stage owns are skipped).

    A ``post_block`` site runs inside the norm that adds its stream (a :class:`SteeredNorm`
    in place of the next layer's input norm, or of the final norm), so that on CUDA the site
    and that norm are one kernel; it steers the same tensor with the same inputs as around the
    layer, which is where it stays when :func:`_norm_after` finds no such norm. (vLLM's EAGLE-3
    auxiliary hidden states, read between layers, then see the stream before the site.)"""
    spec = arch_spec_for(model)
    layers = decoder_layers(model)
    raw = list(layers)
    by_layer: dict[int, dict[str, nn.Module]] = {}
    for (hook, index), op in ops.items():
        by_layer.setdefault(index, {})[hook] = op
    installed: list[tuple[str, int]] = []
    for index, at in by_layer.items():
        layer = raw[index]
        if not _owned(layer):
            continue
        split = splits_stream(layer)
        if "post_attn" in at:
            norm = getattr(layer, spec.mid_norm)
            steered = SteeredNorm if split else SteeredStreamNorm
            setattr(layer, spec.mid_norm, steered(norm, at["post_attn"]))
        post = at.get("post_block")
        into = None if post is None else _norm_after(model, raw, index, ops)
        if into is not None:
            module, name = into
            setattr(module, name, SteeredNorm(getattr(module, name), post))
            post = None
        if "pre_attn" in at or post is not None:
            wrapper = SteeredLayer if split else SteeredStreamLayer
            layers[index] = wrapper(layer, at.get("pre_attn"), post)
        installed.extend((hook, index) for hook in at)
    return installed


STAGE_GATE_KEY = "dynsteer_gate_score"
"""Key of the tokens' gates and scores in the tensors one pipeline stage hands the next."""


def relay_between_stages(model: nn.Module, gate_score: torch.Tensor,
                         made: Any = None) -> None:
    """Pipeline parallelism: a token's gate is computed at its monitor site, on one stage, and
    read by gated sites and controllers on later stages too, so it travels with the stream.

    Every stage but the last adds its ``gate_score`` (``float32 [2, max_tokens]``) to the
    ``IntermediateTensors`` it returns, as ``[tokens, 2]``, and every stage but the first
    receives it straight into its own ``gate_score``: the runner copies incoming tensors into
    the persistent buffers ``make_empty_intermediate_tensors`` made, and the one made for this
    key is a view of ``gate_score``. A later stage's monitor sites overwrite their tokens'
    gates, as on one GPU. ``made`` is the runner's persistent buffers where its ``load_model``
    already made them (the V2 runner does; the V1 and CPU runners make them on first use): the
    key joins them too, since the V2 runner copies only the keys its buffers have (without it,
    later stages would read no gates).
    """
    from vllm.distributed import get_pp_group

    stages = get_pp_group()
    if stages.world_size == 1:
        return
    columns = gate_score.t()
    if not stages.is_first_rank:
        make_empty = model.make_empty_intermediate_tensors

        def make_empty_with_gates(batch_size: int, dtype: torch.dtype, device: torch.device):
            tensors = make_empty(batch_size=batch_size, dtype=dtype, device=device)
            tensors.tensors[STAGE_GATE_KEY] = columns[:batch_size]
            return tensors

        model.make_empty_intermediate_tensors = make_empty_with_gates
        if made is not None:
            made.tensors[STAGE_GATE_KEY] = columns[: len(next(iter(made.tensors.values())))]
    if not stages.is_last_rank:
        outgoing = torch.zeros_like(columns, memory_format=torch.contiguous_format)
        forward = model.forward

        def forward_with_gates(*args, **kwargs):
            out = forward(*args, **kwargs)
            tokens = out["hidden_states"].shape[0]
            outgoing[:tokens].copy_(columns[:tokens])
            out.tensors[STAGE_GATE_KEY] = outgoing[:tokens]
            return out

        model.forward = forward_with_gates
