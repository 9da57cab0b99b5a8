"""The independent reference: HF transformers with the same steering written as plain hooks.

``pre_attn`` adds to the layer's input, ``post_attn`` to the attention branch's output (so to
the stream after the attention residual add; :func:`attention_branch` says what that branch is
per architecture), ``post_block`` to the layer's output; each only at the
positions of the entry's phase (prompt positions = prefill, generated = decode) that its
``positions`` name, if it names some (a ``norm_match`` add is scaled by the norm of the
stream reaching the site). An ``ablate`` /
``clamp`` entry acts on the whole residual stream there (for ``post_attn``: the layer input plus
the attention output), one entry after the other, static entries before gated ones, all before
the adds. A gate reads the stream at its monitor site *before* that site's steering, in
float64, and scales its entries per position at that site and every later one.

The comparisons of engine results with it (logprobs, captured streams) are here too, with their
tolerances: one helper per kind of result, used by every test module.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from engine_utils import LOGPROB_ATOL, generated_logprobs, logprobs_of
from tiny_models import HIDDEN

HOOKS = ("pre_attn", "post_attn", "post_block")

CAPTURE_ATOL = 1e-3 if torch.cuda.is_available() else 2e-4
"""A stream the engine captured (fp32) vs the same stream recorded in HF (on CUDA the engine's
attention and matmul kernels sum in another order than HF's CPU reference does)."""


def _phase_mask(phase: str, seq_len: int, prompt_len: int) -> torch.Tensor:
    mask = torch.zeros(seq_len, 1, dtype=torch.float64)
    if phase in ("all", "prefill"):
        mask[:prompt_len] = 1
    if phase in ("all", "decode"):
        mask[prompt_len:] = 1
    return mask


def _position(text: str | int, prompt_len: int) -> int:
    """One position of an entry's ``positions``, written out independently of the product's
    parser: ``gK`` is generated token K, a negative index counts from the prompt's end."""
    if isinstance(text, str) and text.startswith("g"):
        return prompt_len + int(text[1:])
    return int(text) + prompt_len if int(text) < 0 else int(text)


def _mask(e: dict[str, Any], seq_len: int, prompt_len: int) -> torch.Tensor:
    """Where an entry steers: its phase's positions that its ``positions`` names."""
    mask = _phase_mask(e.get("phase", "all"), seq_len, prompt_len)
    named = e.get("positions")
    if named is None or named == "all":
        return mask
    keep = torch.zeros(seq_len, 1, dtype=torch.float64)
    if named == "prompt":
        keep[:prompt_len] = 1
    elif named == "generated":
        keep[prompt_len:] = 1
    elif named == "last_prompt":
        keep[prompt_len - 1] = 1
    else:
        for item in named:
            if isinstance(item, str) and ":" in item:
                a, b = item.split(":")
                start = _position(a, prompt_len) if a else 0
                stop = _position(b, prompt_len) if b else seq_len
                keep[max(start, 0):max(stop, 0)] = 1
            elif 0 <= _position(item, prompt_len) < seq_len:
                keep[_position(item, prompt_len)] = 1
    return mask * keep


def _vector(e: dict[str, Any], vectors: dict) -> torch.Tensor:
    vec = e["vector"]
    return torch.tensor(vectors[vec] if isinstance(vec, str) else vec, dtype=torch.float64)


def _projections(entries, seq_len, prompt_len, vectors) -> dict[tuple[str, int], list]:
    """Per site, in entry order: (unit direction, scale per position, target projection)."""
    out: dict[tuple[str, int], list] = {}
    for e in entries:
        if e.get("op", "add") == "add":
            continue
        direction = _vector(e, vectors)
        direction = direction / direction.norm()
        scale = _mask(e, seq_len, prompt_len) * e.get("scale", 1.0)
        for layer in e["layers"]:
            out.setdefault((e.get("hook", "post_block"), layer), []).append(
                (direction, scale, e.get("value", 0.0)))
    return out


def _project(stream: torch.Tensor, items: list, gates: torch.Tensor | None) -> torch.Tensor:
    """``stream`` (float64) after each projection in turn (scaled by ``gates`` if given)."""
    for direction, scale, value in items:
        c = scale if gates is None else scale * gates[:, None]
        stream = stream + c * (value - (stream @ direction)[..., None]) * direction
    return stream


def _norm_matched(entries, seq_len, prompt_len, vectors) -> dict[tuple[str, int], list]:
    """Per site, the ``norm_match`` adds: (``scale`` per position times the unit vector)."""
    out: dict[tuple[str, int], list] = {}
    for e in entries:
        if not e.get("norm_match"):
            continue
        unit = _vector(e, vectors) / _vector(e, vectors).norm()
        for layer in e["layers"]:
            out.setdefault((e.get("hook", "post_block"), layer), []).append(
                _mask(e, seq_len, prompt_len) * e.get("scale", 1.0) * unit)
    return out


def _deltas(entries, seq_len, prompt_len, vectors) -> dict[tuple[str, int], torch.Tensor]:
    out: dict[tuple[str, int], torch.Tensor] = {}
    for e in entries:
        if e.get("op", "add") != "add" or e.get("norm_match"):
            continue
        vec = e["vector"]
        vec = torch.tensor(vectors[vec] if isinstance(vec, str) else vec, dtype=torch.float64)
        add = _mask(e, seq_len, prompt_len) * vec * e.get("scale", 1.0)
        for layer in e["layers"]:
            key = (e.get("hook", "post_block"), layer)
            out[key] = out[key] + add if key in out else add
    return out


class Steerer:
    """Static + gated deltas per site, and the gate computed at the monitor site."""

    def __init__(self, entries, gate, seq_len, prompt_len, vectors, probes,
                 gate_fn=None) -> None:
        self.static = _deltas(entries, seq_len, prompt_len, vectors)
        self.static_projections = _projections(entries, seq_len, prompt_len, vectors)
        self.static_matched = _norm_matched(entries, seq_len, prompt_len, vectors)
        self.gated_projections: dict[tuple[str, int], list] = {}
        self.gated_matched: dict[tuple[str, int], list] = {}
        self.gate_fn = gate_fn
        """``gate_fn(scores, gates) -> gates`` (numpy, per position): a controller's decisions
        on top of the probe's gates (None: the gates as they are)."""
        self.gated: dict[tuple[str, int], torch.Tensor] = {}
        self.monitor = None
        self.gates: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        if gate is not None:
            self.gated = _deltas(gate["steer"], seq_len, prompt_len, vectors)
            self.gated_projections = _projections(gate["steer"], seq_len, prompt_len, vectors)
            self.gated_matched = _norm_matched(gate["steer"], seq_len, prompt_len, vectors)
            probe = gate["probe"]
            probe = probes[probe] if isinstance(probe, str) else probe
            self.w = torch.tensor(probe["weights"], dtype=torch.float64)
            self.threshold = gate.get("threshold")
            self.threshold = probe.get("threshold", 0.0) if self.threshold is None else \
                self.threshold
            self.sharpness = gate.get("sharpness") or probe.get("sharpness", 1.0)
            self.monitor = (gate.get("hook", "post_block"), gate["layer"])

    def apply(self, site: tuple[str, int], stream: torch.Tensor, x: torch.Tensor):
        if site == self.monitor:
            self.scores = stream[0].double() @ self.w
            self.gates = torch.sigmoid(self.sharpness * (self.scores - self.threshold))
            if self.gate_fn is not None:
                self.gates = torch.as_tensor(
                    self.gate_fn(self.scores.numpy(), self.gates.numpy()), dtype=torch.float64)
        delta = self.static.get(site)
        if site in self.gated:
            assert self.gates is not None, "gated site before the monitor"
            g = self.gates[:, None] * self.gated[site]
            delta = g if delta is None else delta + g
        if site in self.static_projections or site in self.gated_projections:
            z = stream[0].double()
            projected = _project(z, self.static_projections.get(site, []), None)
            if site in self.gated_projections:
                assert self.gates is not None, "gated site before the monitor"
                projected = _project(projected, self.gated_projections[site], self.gates)
            delta = projected - z if delta is None else delta + projected - z
        # norm_match: the incoming stream's norm (fp64 here) times each entry's scaled unit.
        norm = stream[0].double().norm(dim=-1, keepdim=True)
        for add in self.static_matched.get(site, []):
            delta = norm * add if delta is None else delta + norm * add
        for add in self.gated_matched.get(site, []):
            assert self.gates is not None, "gated site before the monitor"
            g = self.gates[:, None] * norm * add
            delta = g if delta is None else delta + g
        return x if delta is None else x + delta.to(x.dtype)


ATTENTION_OUTPUT_NORM = {"gemma2": "post_attention_layernorm",
                         "gemma3_text": "post_attention_layernorm",
                         "afmoe": "post_attention_layernorm",
                         "exaone4": "post_attention_layernorm",
                         "glm4": "post_self_attn_layernorm",
                         "olmo2": "post_attention_layernorm",
                         "olmo3": "post_attention_layernorm"}
"""HF model types whose layers normalize the attention output before adding it to the stream
(sandwich and post-norm layers): the norm's name."""


def attention_branch(model, layer) -> tuple[torch.nn.Module, float]:
    """The module whose output HF adds to the residual stream after attention, and the factor
    it is added with: the attention itself in Llama-like layers (GPT-2's ``attn``), its
    output norm in sandwich and post-norm layers (:data:`ATTENTION_OUTPUT_NORM`), the
    attention or Mamba mixer scaled by ``residual_multiplier`` in Granite's."""
    norm = ATTENTION_OUTPUT_NORM.get(model.config.model_type)
    if norm is not None:
        return getattr(layer, norm), 1.0
    mixer = next(m for m in (getattr(layer, "mamba", None), getattr(layer, "self_attn", None),
                             getattr(layer, "attn", None), getattr(layer, "attention", None))
                 if m is not None)
    return mixer, float(getattr(model.config, "residual_multiplier", 1.0))


def decoder_layers(model) -> torch.nn.ModuleList:
    """An HF causal LM's decoder layers (GPT-2 keeps them in ``transformer.h``, OPT in
    ``model.decoder.layers``, GPT-NeoX in ``gpt_neox.layers``)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        found = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if found is not None:
            return found
    raise AttributeError(f"no decoder layers found in {type(model).__name__}")


@contextmanager
def steering_hooks(model, steerer: Steerer):
    """Register forward hooks implementing ``steerer`` on an HF causal LM. ``post_attn`` is
    the stream right after attention's residual add, ``input + factor * branch`` (see
    :func:`attention_branch`); its delta goes into the branch's output, divided by the factor."""
    handles = []
    inputs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(decoder_layers(model)):
        branch, factor = attention_branch(model, layer)
        def pre_hook(mod, args, kwargs, i=i):
            hs = args[0] if args else kwargs["hidden_states"]
            hs = steerer.apply(("pre_attn", i), hs, hs)
            inputs[i] = hs
            if args:
                return (hs, *args[1:]), kwargs
            kwargs["hidden_states"] = hs
            return args, kwargs

        def attn_hook(mod, args, output, i=i, factor=factor):
            added = factor * (output[0] if isinstance(output, tuple) else output)
            out = steerer.apply(("post_attn", i), inputs[i] + added, added) / factor
            return (out, *output[1:]) if isinstance(output, tuple) else out

        def post_hook(mod, args, output, i=i):
            hs = output[0] if isinstance(output, tuple) else output
            hs = steerer.apply(("post_block", i), hs, hs)
            return (hs, *output[1:]) if isinstance(output, tuple) else hs

        handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(branch.register_forward_hook(attn_hook))
        handles.append(layer.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_reference(model: Any, tokens: Sequence[int], prompt_len: int,
                  entries: Sequence[dict[str, Any]] = (), vectors: dict | None = None,
                  gate: dict[str, Any] | None = None,
                  probes: dict[str, dict] | None = None,
                  gate_fn=None) -> tuple[np.ndarray, Steerer]:
    """(log-probability of each token ``tokens[1:]`` given its prefix, the steerer)."""
    steerer = Steerer(entries, gate, len(tokens), prompt_len, vectors or {}, probes or {},
                      gate_fn)
    ids = torch.tensor([list(tokens)])
    with torch.no_grad(), steering_hooks(model, steerer):
        logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    nxt = torch.tensor(tokens[1:])
    return logp[torch.arange(len(tokens) - 1), nxt].numpy(), steerer


class _Recorder(Steerer):
    """Records the stream each site sees (float64, ``[seq, H]``), before the site's steering."""

    def __init__(self, entries, seq_len, vectors, gate=None, prompt_len=None,
                 probes=None) -> None:
        super().__init__(entries, gate, seq_len, seq_len if prompt_len is None else prompt_len,
                         vectors, probes or {})
        self.streams: dict[tuple[str, int], np.ndarray] = {}

    def apply(self, site, stream, x):
        self.streams[site] = stream[0].double().numpy().copy()
        return super().apply(site, stream, x)


def record_streams(model: Any, tokens: Sequence[int], entries: Sequence[dict[str, Any]] = (),
                   vectors: dict | None = None, gate: dict[str, Any] | None = None,
                   prompt_len: int | None = None,
                   probes: dict[str, dict] | None = None) -> dict[tuple[str, int], np.ndarray]:
    """The residual stream of a forward over ``tokens`` at every (hook, layer), ``[len, H]``.

    ``pre_attn``: the layer's input; ``post_attn``: input + attention branch; ``post_block``:
    the layer's output (TransformerLens resid_pre / resid_mid / resid_post); each read before
    that site's own steering by ``entries`` and ``gate`` (the first ``prompt_len`` positions
    are prompt positions; None: all of them).
    """
    recorder = _Recorder(entries, len(tokens), vectors or {}, gate, prompt_len, probes)
    with torch.no_grad(), steering_hooks(model, recorder):
        model(torch.tensor([list(tokens)]))
    return recorder.streams


def reference_logprobs(model: Any, tokens: Sequence[int], prompt_len: int,
                       entries: Sequence[dict[str, Any]] = (), vectors: dict | None = None,
                       gate: dict[str, Any] | None = None,
                       probes: dict[str, dict] | None = None) -> np.ndarray:
    return run_reference(model, tokens, prompt_len, entries, vectors, gate, probes)[0]


def load_hf(path: Any) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def assert_logprobs_match_hf(hf: Any, out: Any, entries: Sequence[dict[str, Any]] = (),
                             vectors: dict | None = None, gate: dict[str, Any] | None = None,
                             probes: dict[str, dict] | None = None, gate_fn=None,
                             ) -> tuple[list[int], np.ndarray, Steerer]:
    """The logprobs a finished engine request reported equal an HF run over its tokens with the
    same steering (``atol`` :data:`LOGPROB_ATOL`): of every prompt and generated token, or of
    the generated ones only where the request asked for no prompt logprobs (vLLM reads the
    prefix cache only then). Returns (all tokens, HF logprob of ``tokens[1:]``, HF steerer)."""
    prompt_len = len(out.prompt_token_ids)
    if out.prompt_logprobs is None:
        gen, got = generated_logprobs(out)
        tokens, first = list(out.prompt_token_ids) + gen, prompt_len - 1
    else:
        (tokens, got), first = logprobs_of(out), 0
    want, steerer = run_reference(hf, tokens, prompt_len, entries, vectors, gate, probes,
                                  gate_fn)
    np.testing.assert_allclose(got, want[first:], atol=LOGPROB_ATOL)
    return tokens, want, steerer


def assert_capture_matches_hf(result: dict[str, Any],
                              streams: Sequence[dict[tuple[str, int], np.ndarray]],
                              reduce: str) -> None:
    """``result`` (one capture: site -> arrays) equals the HF streams of every prompt (from
    :func:`record_streams`), reduced (``atol`` :data:`CAPTURE_ATOL`)."""
    for site, got in result.items():
        hook, layer = site.split("@")
        want = [s[(hook, int(layer))] for s in streams]
        if reduce == "all":
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == np.float32 and g.shape == w.shape
                np.testing.assert_allclose(g, w, atol=CAPTURE_ATOL, err_msg=site)
        else:
            reduced = np.stack([w[-1] if reduce == "last" else w.mean(0) for w in want])
            assert got.dtype == np.float32 and got.shape == (len(want), HIDDEN)
            np.testing.assert_allclose(got, reduced, atol=CAPTURE_ATOL, err_msg=site)
