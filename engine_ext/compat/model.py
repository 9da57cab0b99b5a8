"""vLLM's decoder-layer contract: where the residual stream is and how a site is wrapped in.

vLLM decoder layers (Llama, Qwen2, Qwen3) take ``(positions, hidden_states, residual)`` and return
``(hidden_states, residual)``; the residual stream after a layer is ``hidden_states + residual``
and layer 0 receives ``residual=None``. A site's module ``op(x, h=None)`` returns ``x`` steered,
reading the stream ``x + h``; it is applied to ``residual`` (or to ``hidden_states`` at layer 0's
entry), so every later layer sees it:

* ``pre_attn``  (TransformerLens ``resid_pre``): wrapper around the layer, before it;
* ``post_attn`` (``resid_mid``): wrapper around the post-attention norm, which is where vLLM
  fuses the attention residual add;
* ``post_block`` (``resid_post``): wrapper around the layer, after it.

Layers and norms are wrapped (not hooked), so torch.compile traces the ops into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """How to reach the sites of one model class (verified against HF transformers)."""

    post_attn_norm: str
    """The norm that receives ``(attn_out, residual)`` right after attention."""


SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(post_attn_norm="post_attention_layernorm"),
    "Qwen2ForCausalLM": ArchSpec(post_attn_norm="post_attention_layernorm"),
    "Qwen3ForCausalLM": ArchSpec(post_attn_norm="post_attention_layernorm"),
}
"""Architectures whose layer contract is checked by tests against HF transformers."""


class SteeredLayer(nn.Module):
    """A decoder layer with optional ``pre_attn`` / ``post_block`` sites."""

    def __init__(self, layer: nn.Module, pre: nn.Module | None, post: nn.Module | None) -> None:
        super().__init__()
        self.layer = layer
        self.pre = pre
        self.post = post

    def forward(self, positions, hidden_states, residual, **kwargs):
        if self.pre is not None:
            if residual is None:
                hidden_states = self.pre(hidden_states)
            else:
                residual = self.pre(residual, hidden_states)
        hidden_states, residual = self.layer(positions, hidden_states, residual, **kwargs)
        if self.post is not None:
            residual = self.post(residual, hidden_states)
        return hidden_states, residual


class SteeredNorm(nn.Module):
    """A fused add+norm whose residual input is steered first (the ``post_attn`` site)."""

    def __init__(self, norm: nn.Module, site: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.site = site

    def forward(self, x, residual=None):
        if residual is None:
            raise RuntimeError("dynsteer post_attn site expects the norm to receive a residual")
        return self.norm(x, self.site(residual, x))


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


def wrap_sites(model: nn.Module, ops: dict[tuple[str, int], nn.Module]) -> list[tuple[str, int]]:
    """Put each ``(hook, layer)`` op into the model; returns the sites installed here (sites
    on layers another pipeline stage owns are skipped)."""
    spec = arch_spec_for(model)
    layers = decoder_layers(model)
    by_layer: dict[int, dict[str, nn.Module]] = {}
    for (hook, index), op in ops.items():
        by_layer.setdefault(index, {})[hook] = op
    installed: list[tuple[str, int]] = []
    for index, at in by_layer.items():
        layer = layers[index]
        if not _owned(layer):
            continue
        if "post_attn" in at:
            norm = getattr(layer, spec.post_attn_norm)
            setattr(layer, spec.post_attn_norm, SteeredNorm(norm, at["post_attn"]))
        if "pre_attn" in at or "post_block" in at:
            layers[index] = SteeredLayer(layer, at.get("pre_attn"), at.get("post_block"))
        installed.extend((hook, index) for hook in at)
    return installed
