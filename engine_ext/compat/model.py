"""Sites in vLLM's models: each decoder layer's contract is read from its code
(:mod:`.layer_contract`) and the sites are wrapped in where that contract puts the stream.

A site's module ``op(x, h=None)`` returns ``x`` steered, reading the stream ``x + h``:

* ``pre_attn``  (TransformerLens ``resid_pre``): a wrapper around the layer, before it. In a
  two-stream layer (vLLM's ``(hidden_states, residual)`` pair, the stream their sum) it steers
  ``residual`` (``hidden_states`` where the residual is None: layer 0); elsewhere the stream
  argument itself;
* ``post_attn`` (``resid_mid``): where the contract found the stream after attention's add:
  in a fused add + norm (Llama's ``post_attention_layernorm``, Gemma's
  ``pre_feedforward_layernorm``), whose residual input is steered; or as the input of the
  module that first reads it (a norm in Granite, the MLP in post-norm layers), steered *in
  place* so that the layer's later residual add (the same tensor) carries the steering too
  (torch.compile's functionalization keeps the aliasing). Layers without that point (parallel
  attention + MLP, token-mixer-only layers) have no ``post_attn`` and refuse it at start-up;
* ``post_block`` (``resid_post``): a wrapper around the layer, after it: on the pair's
  residual, on the returned stream, or on the first item of a returned tuple. Where the layer
  returns a pair and the next layer's entry norm is vLLM's fused add + RMSNorm (the model's
  final norm after the last layer), the site runs inside that norm instead (see
  :func:`wrap_sites`).

Layers and norms are wrapped (not hooked), so torch.compile traces the ops into the graph.
What each hook means per architecture, in terms of HF transformers' residual stream, is
docs/architectures.md; ``tests/hf_reference.py`` checks it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .census import VERIFIED, architecture_of
from .layer_contract import LayerContract, Refused, layer_contract

logger = logging.getLogger("dynsteer")

LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "transformer.layers",
               "backbone.layers", "gpt_neox.layers", "model.transformer.h")
"""Where models keep their decoder layers (``nn.ModuleList``), tried in order."""


class _Wrapper(nn.Module):
    """A module with a site; attributes it does not have are read from the module it wraps,
    so model code that reaches into it (GPT-OSS reads ``layers[i].mlp.experts``) still can."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


class SteeredLayer(_Wrapper):
    """A decoder layer with ``pre_attn`` / ``post_block`` sites around it, placed by its
    contract: which argument is the stream, whether a residual is its other part, and what
    the layer returns."""

    def __init__(self, layer: nn.Module, pre: nn.Module | None, post: nn.Module | None,
                 contract: LayerContract) -> None:
        super().__init__()
        self.inner = layer
        self.pre = pre
        self.post = post
        self.stream_at = contract.params.index(contract.stream_arg)
        self.stream_name = contract.stream_arg
        self.residual_at = (contract.params.index("residual") if contract.split_input
                            else None)
        self.output = contract.output

    @property
    def layer(self) -> nn.Module:
        return self.inner

    def _arg(self, args: list, kwargs: dict, at: int, name: str):
        return args[at] if at < len(args) else kwargs.get(name)

    def _set(self, args: list, kwargs: dict, at: int, name: str, value) -> None:
        if at < len(args):
            args[at] = value
        else:
            kwargs[name] = value

    def forward(self, *args, **kwargs):
        args = list(args)
        if self.pre is not None:
            hidden = self._arg(args, kwargs, self.stream_at, self.stream_name)
            residual = (None if self.residual_at is None
                        else self._arg(args, kwargs, self.residual_at, "residual"))
            if residual is None:
                self._set(args, kwargs, self.stream_at, self.stream_name, self.pre(hidden))
            else:
                self._set(args, kwargs, self.residual_at, "residual",
                          self.pre(residual, hidden))
        out = self.inner(*args, **kwargs)
        if self.post is None:
            return out
        if self.output == "split":
            hidden, residual = out
            return hidden, self.post(residual, hidden)
        if self.output == "first":
            return (self.post(out[0]), *out[1:])
        return self.post(out)


def fusable_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is vLLM's plain weighted RMSNorm, whose fused add + norm
    ``dynsteer::steer_norm`` computes in the site's kernel (Gemma's ``1 + weight`` norm, a
    norm without weight or over part of the row are not)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and norm.has_weight and norm.pass_weight_add
            and norm.variance_size_override is None)


class SteeredNorm(_Wrapper):
    """A fused add+norm whose residual input is steered first: ``post_attn`` of layers that
    add attention's output in their norm, and ``post_block`` moved into the next layer's entry
    norm (see :func:`wrap_sites`).

    Where the site can (:meth:`.SiteOp.fuses_norm`: on CUDA) and the norm is vLLM's plain
    RMSNorm, the site and the norm run as one op (``dynsteer::steer_norm``, one kernel),
    with the norm's weight and epsilon; elsewhere the site runs, then the norm."""

    def __init__(self, norm: nn.Module, site: nn.Module) -> None:
        super().__init__()
        self.inner = norm
        self.site = site
        self.fusable = fusable_norm(norm) and hasattr(site, "fuses_norm")

    @property
    def norm(self) -> nn.Module:
        return self.inner

    def forward(self, x, residual=None):
        if residual is None:
            raise RuntimeError("dynsteer: a steered norm expects to receive a residual")
        if self.fusable and self.site.fuses_norm(residual):
            return self.site.steer_norm(residual, x, self.inner.weight,
                                        self.inner.variance_epsilon)
        return self.inner(x, self.site(residual, x))


class SteeredInput(_Wrapper):
    """A module whose input, the whole stream, is steered in place first (``post_attn`` where
    the layer computes the stream after attention itself): the layer keeps the same tensor as
    the residual of its MLP add."""

    def __init__(self, module: nn.Module, site: nn.Module) -> None:
        super().__init__()
        self.inner = module
        self.site = site

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        x.copy_(self.site(x))
        return self.inner(*args, **kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers (see :data:`LAYER_PATHS`)."""
    for path in LAYER_PATHS:
        found: Any = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, nn.ModuleList):
            return found
    raise RuntimeError(
        f"dynsteer: {type(model).__name__} keeps its decoder layers in none of "
        f"{', '.join(LAYER_PATHS)}; its layer contract is unknown"
    )


def _owned(layer: nn.Module) -> bool:
    """False for a layer another pipeline stage runs (vLLM's ``PPMissingLayer``)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return not isinstance(layer, PPMissingLayer)


def _dtype(layer: nn.Module) -> torch.dtype | None:
    param = next((p for p in layer.parameters() if p.is_floating_point()), None)
    return None if param is None else param.dtype


def layer_contracts(model: nn.Module) -> dict[int, LayerContract]:
    """The contract of each layer this stage owns, or a start-up error naming the model class,
    the layer class and why its stream cannot be placed."""
    name = type(model).__name__
    contracts: dict[int, LayerContract] = {}
    for index, layer in enumerate(decoder_layers(model)):
        if not _owned(layer):
            continue
        try:
            contracts[index] = layer_contract(type(layer), layer, _dtype(layer))
        except Refused as exc:
            raise RuntimeError(
                f"dynsteer does not support the model class {name}: layer {index} "
                f"({type(layer).__name__}) {exc}; start the engine without "
                "additional_config['dynsteer'] to serve it unsteered") from None
    architecture = architecture_of(model)
    if architecture not in VERIFIED:
        logger.warning("dynsteer: %s's layers follow a known contract but the class is not "
                       "verified against HF transformers (docs/architectures.md)", architecture)
    return contracts


def _norm_after(model: nn.Module, layers: list[nn.Module], index: int,
                ops: dict[tuple[str, int], nn.Module],
                contracts: dict[int, LayerContract]) -> tuple[nn.Module, str] | None:
    """Where a ``post_block`` site of layer ``index`` can run inside the norm that adds its
    stream: ``(module, attribute)`` of the next layer's entry norm (the model's final norm
    after the last layer), or None. None where the layer does not return a pair, the next
    layer belongs to another pipeline stage, has a ``pre_attn`` site (that site steers the
    same stream after this one) or does not take the pair into a fused entry norm, or the norm
    is not vLLM's plain RMSNorm."""
    if contracts[index].output != "split":
        return None
    if index + 1 < len(layers):
        nxt = contracts.get(index + 1)
        if nxt is None or ("pre_attn", index + 1) in ops or nxt.entry_norm is None:
            return None
        if not fusable_norm(getattr(layers[index + 1], nxt.entry_norm, None)):
            return None
        return layers[index + 1], nxt.entry_norm
    inner = getattr(model, "model", None)
    return (inner, "norm") if fusable_norm(getattr(inner, "norm", None)) else None


def wrap_sites(model: nn.Module, ops: dict[tuple[str, int], nn.Module]) -> list[tuple[str, int]]:
    """Put each ``(hook, layer)`` op into the model; returns the sites installed here (sites
    on layers another pipeline stage owns are skipped). A hook a layer does not have
    (``post_attn`` in a parallel attention + MLP layer) stops the engine naming the layer.

    A ``post_block`` site runs inside the norm that adds its stream (a :class:`SteeredNorm`
    in place of the next layer's entry norm, or of the final norm), so that on CUDA the site
    and that norm are one kernel; it steers the same tensor with the same inputs as around the
    layer, which is where it stays when :func:`_norm_after` finds no such norm. (vLLM's EAGLE-3
    auxiliary hidden states, read between layers, then see the stream before the site.)"""
    contracts = layer_contracts(model)
    layers = decoder_layers(model)
    raw = list(layers)
    by_layer: dict[int, dict[str, nn.Module]] = {}
    for (hook, index), op in ops.items():
        by_layer.setdefault(index, {})[hook] = op
    installed: list[tuple[str, int]] = []
    for index, at in by_layer.items():
        if index not in contracts:
            continue
        layer, contract = raw[index], contracts[index]
        if "post_attn" in at:
            if contract.mid is None:
                raise RuntimeError(
                    f"dynsteer: layer {index} ({type(layer).__name__}: {contract.kind}) has "
                    f"no post_attn; remove post_attn@{index} from the engine option sites")
            module = getattr(layer, contract.mid)
            steered = SteeredNorm if contract.mid_fused else SteeredInput
            setattr(layer, contract.mid, steered(module, at["post_attn"]))
        post = at.get("post_block")
        into = None if post is None else _norm_after(model, raw, index, ops, contracts)
        if into is not None:
            module, name = into
            setattr(module, name, SteeredNorm(getattr(module, name), post))
            post = None
        if "pre_attn" in at or post is not None:
            layers[index] = SteeredLayer(layer, at.get("pre_attn"), post, contract)
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
