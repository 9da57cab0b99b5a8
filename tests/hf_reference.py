"""The independent reference: HF transformers with the same steering written as plain hooks.

``pre_attn`` adds to the layer's input, ``post_attn`` to the attention output (so to the stream
after the attention residual add), ``post_block`` to the layer's output; each only at the
positions of the entry's phase (prompt positions = prefill, generated = decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def _delta(entries: Sequence[dict[str, Any]], hook: str, layer: int, seq_len: int,
           prompt_len: int, vectors: dict[str, Sequence[float]]) -> torch.Tensor | None:
    out = None
    for e in entries:
        if e.get("hook", "post_block") != hook or layer not in e["layers"]:
            continue
        vec = e["vector"]
        vec = torch.tensor(vectors[vec] if isinstance(vec, str) else vec, dtype=torch.float64)
        mask = torch.zeros(seq_len, 1, dtype=torch.float64)
        phase = e.get("phase", "all")
        if phase in ("all", "prefill"):
            mask[:prompt_len] = 1
        if phase in ("all", "decode"):
            mask[prompt_len:] = 1
        add = mask * vec * float(e.get("scale", 1.0))
        out = add if out is None else out + add
    return None if out is None else out.to(torch.float32)


@contextmanager
def steering_hooks(model: Any, entries: Sequence[dict[str, Any]], seq_len: int,
                   prompt_len: int, vectors: dict[str, Sequence[float]] | None = None):
    """Register forward hooks implementing ``entries`` on an HF causal LM."""
    vectors = vectors or {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        pre = _delta(entries, "pre_attn", i, seq_len, prompt_len, vectors)
        mid = _delta(entries, "post_attn", i, seq_len, prompt_len, vectors)
        post = _delta(entries, "post_block", i, seq_len, prompt_len, vectors)
        if pre is not None:
            def pre_hook(mod, args, kwargs, d=pre):
                if args:
                    return (args[0] + d, *args[1:]), kwargs
                kwargs["hidden_states"] = kwargs["hidden_states"] + d
                return args, kwargs
            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        if mid is not None:
            def attn_hook(mod, args, output, d=mid):
                return (output[0] + d, *output[1:])
            handles.append(layer.self_attn.register_forward_hook(attn_hook))
        if post is not None:
            def post_hook(mod, args, output, d=post):
                if isinstance(output, tuple):
                    return (output[0] + d, *output[1:])
                return output + d
            handles.append(layer.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference_logprobs(model: Any, tokens: Sequence[int], prompt_len: int,
                       entries: Sequence[dict[str, Any]] = (),
                       vectors: dict[str, Sequence[float]] | None = None) -> np.ndarray:
    """Log-probability of each token ``tokens[1:]`` given its prefix, under steering."""
    ids = torch.tensor([list(tokens)])
    with torch.no_grad(), steering_hooks(model, entries, len(tokens), prompt_len, vectors):
        logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    nxt = torch.tensor(tokens[1:])
    return logp[torch.arange(len(tokens) - 1), nxt].numpy()


def load_hf(path: Any) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
