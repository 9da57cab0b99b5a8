"""Puts one steering op at each configured site of a loaded vLLM model.

vLLM decoder layers (Llama, Qwen2, Qwen3) take ``(positions, hidden_states, residual)`` and return
``(hidden_states, residual)``; the residual stream after a layer is ``hidden_states + residual``
and layer 0 receives ``residual=None``. Steering is added to ``residual`` (or to
``hidden_states`` at layer 0's entry), so every later layer sees it:

* ``pre_attn``  (TransformerLens ``resid_pre``): wrapper around the layer, before it;
* ``post_attn`` (``resid_mid``): wrapper around the post-attention norm, which is where vLLM
  fuses the attention residual add;
* ``post_block`` (``resid_post``): wrapper around the layer, after it.

Layers and norms are wrapped (not hooked), so torch.compile traces the ops into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynsteer.controller.spec import Hook
from dynsteer.engine_ext.options import Site


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


@dataclass(frozen=True)
class SiteBuffers:
    """The persistent buffers one site's op reads (views into the worker's steering state)."""

    index: int
    """Position of the site in forward order (what probe params store as the monitor site)."""
    rows: torch.Tensor
    probe_rows: torch.Tensor
    table: torch.Tensor
    dyn: torch.Tensor
    flags: torch.Tensor
    probes: torch.Tensor
    params: torch.Tensor
    gate: torch.Tensor
    score: torch.Tensor
    capture_rows: torch.Tensor
    """Per-token capture row (0: not captured)."""
    capture: torch.Tensor
    """The capture buffer ``[K, C + 1, H]`` shared by all sites."""
    site_lane: torch.Tensor
    """Per site: its capture lane, -1 when not captured."""


class SiteOp(nn.Module):
    """The steering op of one site; buffers are shared with the worker's steering state."""

    def __init__(self, buffers: SiteBuffers) -> None:
        super().__init__()
        self.site_index = buffers.index
        for name in ("rows", "probe_rows", "table", "dyn", "flags", "probes", "params", "gate",
                     "score", "capture_rows", "capture", "site_lane"):
            self.register_buffer(name, getattr(buffers, name), persistent=False)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """Steer ``x``; the stream the monitor reads is ``x + h`` (``x`` alone when h is None)."""
        n = x.shape[0]
        return torch.ops.dynsteer.steer(
            x, h, self.rows[:n], self.probe_rows[:n], self.table, self.dyn, self.flags,
            self.probes, self.params, self.gate, self.score, self.capture_rows[:n], self.capture,
            self.site_lane, self.site_index,
        )


class SteeredLayer(nn.Module):
    """A decoder layer with optional ``pre_attn`` / ``post_block`` sites."""

    def __init__(self, layer: nn.Module, pre: SiteOp | None, post: SiteOp | None) -> None:
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

    def __init__(self, norm: nn.Module, site: SiteOp) -> None:
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


def install_sites(
    model: nn.Module,
    layers: nn.ModuleList,
    buffers: dict[Site, SiteBuffers],
) -> list[Site]:
    """Wrap the layers so each configured site runs its op; returns the sites installed here.

    Sites on layers another pipeline stage owns (``PPMissingLayer``) are skipped.
    """
    spec = arch_spec_for(model)
    by_layer: dict[int, dict[Hook, SiteOp]] = {}
    for (hook, index), site_buffers in buffers.items():
        by_layer.setdefault(index, {})[hook] = SiteOp(site_buffers)
    installed: list[Site] = []
    for index, ops in by_layer.items():
        layer = layers[index]
        if type(layer).__name__ == "PPMissingLayer":
            continue
        if "post_attn" in ops:
            norm = getattr(layer, spec.post_attn_norm)
            setattr(layer, spec.post_attn_norm, SteeredNorm(norm, ops["post_attn"]))
        if "pre_attn" in ops or "post_block" in ops:
            layers[index] = SteeredLayer(layer, ops.get("pre_attn"), ops.get("post_block"))
        installed.extend((hook, index) for hook in ops)
    return installed
