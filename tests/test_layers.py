"""Site installation on a fake vLLM module tree (no engine).

The fakes keep vLLM's decoder-layer contract (``engine_ext/compat/model.py``): a layer takes
``(positions, hidden_states, residual)`` with ``residual=None`` at layer 0 and returns
``(hidden_states, residual)``; the post-attention norm is a fused add+norm taking
``(x, residual)``. Their math is arbitrary but nonlinear, so a delta put at the wrong site
changes the output.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.utils import PPMissingLayer

from dynsteer.controller.contract import resolve_sites
from dynsteer.controller.extra_args import GLOBAL_KEY
from dynsteer.controller.spec import parse_entries
from dynsteer.controller.wire import entry_to_wire
from dynsteer.engine_ext.compat.model import (
    SteeredInput,
    SteeredLayer,
    SteeredNorm,
    layer_contracts,
    wrap_sites,
)
from dynsteer.engine_ext.compat.worker import norm_passes
from dynsteer.engine_ext.worker.sites import SiteOp, install_sites
from dynsteer.engine_ext.worker.state import SteeringState

H = 4
LAYERS = 4
TOKENS = 5


class FakeNorm(RMSNorm):
    """A fused add+norm: ``(x, residual) -> (norm(x + residual), x + residual)``."""

    def __init__(self, name: str, log: list) -> None:
        with set_current_vllm_config(VllmConfig()):
            super().__init__(H)
        self.name, self.log = name, log

    def forward(self, x, residual):
        self.log.append((self.name, x.clone(), residual.clone()))
        s = x + residual
        return s / (1 + s.abs().mean(-1, keepdim=True)), s


class FakeAttention(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, positions, x):
        return torch.tanh((self.index + 2) * x) + positions[:, None]


class FakeMLP(nn.Module):
    def forward(self, x):
        return torch.sin(3 * x)


class FakeDecoderLayer(nn.Module):
    """A decoder layer with vLLM's contract; logs its inputs, what it hands the norm and its
    outputs as ``layer@i``, ``attn@i`` and ``out@i``. With an ``input_layernorm`` (vLLM's
    RMSNorm) it adds the incoming pair there, as Llama's layers do."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__()
        self.index, self.log = index, log
        self.input_layernorm = None
        self.self_attn = FakeAttention(index)
        self.post_attention_layernorm = FakeNorm(f"norm@{index}", log)
        self.mlp = FakeMLP()

    def forward(self, positions, hidden_states, residual):
        i = self.index
        self.log.append((f"layer@{i}", hidden_states.clone(),
                         None if residual is None else residual.clone()))
        if residual is None:
            residual = hidden_states
        elif self.input_layernorm is not None:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        else:
            residual = hidden_states + residual
        attn = self.self_attn(positions, residual)
        self.log.append((f"attn@{i}", attn.clone(), residual.clone()))
        hidden_states, residual = self.post_attention_layernorm(attn, residual)
        hidden_states = self.mlp(hidden_states)
        self.log.append((f"out@{i}", hidden_states.clone(), residual.clone()))
        return hidden_states, residual


class FakeCausalLM(nn.Module):
    def __init__(self, log: list, missing: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            PPMissingLayer() if i in missing else FakeDecoderLayer(i, log) for i in range(LAYERS))

    def forward(self, positions, x):
        hidden_states, residual = x, None
        for layer in self.model.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states, residual


def fake_model(name: str = "LlamaForCausalLM", log: list | None = None,
               missing: tuple[int, ...] = ()) -> FakeCausalLM:
    """A fake model whose class is called ``name`` (what vLLM's model classes are matched by)."""
    return type(name, (FakeCausalLM,), {})([] if log is None else log, missing)


class RecordingOp(nn.Module):
    """A site op that logs ``(name, x, h)`` and adds ``delta`` to ``x``."""

    def __init__(self, name: str, log: list, delta: torch.Tensor) -> None:
        super().__init__()
        self.name, self.log, self.delta = name, log, delta

    def forward(self, x, h=None):
        self.log.append((self.name, x.clone(), None if h is None else h.clone()))
        return x + self.delta


# Layer 0: pre_attn only (on hidden_states: residual is None there); layer 1: every hook;
# layer 2: post_block only; layer 3: post_attn only (the layer itself stays unwrapped).
SITES = (("pre_attn", 0), ("pre_attn", 1), ("post_attn", 1), ("post_block", 1),
         ("post_block", 2), ("post_attn", 3))


def recording_ops(log: list) -> dict[tuple[str, int], RecordingOp]:
    gen = torch.Generator().manual_seed(0)
    return {(hook, layer): RecordingOp(f"{hook}@{layer}", log, torch.randn(H, generator=gen))
            for hook, layer in SITES}


def test_each_hook_wraps_its_module():
    """pre_attn and post_block wrap the layer, post_attn its post-attention norm; modules of
    layers without that hook are left as they were."""
    model = fake_model()
    layers = list(model.model.layers)
    norms = [layer.post_attention_layernorm for layer in layers]
    ops = recording_ops([])
    installed = wrap_sites(model, ops)
    assert sorted(installed) == sorted(SITES)
    wrapped = model.model.layers
    for i, (pre, post) in enumerate([(True, False), (True, True), (False, True)]):
        assert isinstance(wrapped[i], SteeredLayer) and wrapped[i].layer is layers[i]
        assert wrapped[i].pre is (ops[("pre_attn", i)] if pre else None)
        assert wrapped[i].post is (ops[("post_block", i)] if post else None)
    assert wrapped[3] is layers[3]
    for i in (0, 2):
        assert layers[i].post_attention_layernorm is norms[i]
    for i in (1, 3):
        norm = layers[i].post_attention_layernorm
        assert isinstance(norm, SteeredNorm)
        assert norm.norm is norms[i] and norm.site is ops[("post_attn", i)]


def test_ops_run_in_order_on_the_residual_stream():
    """Each op runs at its place in the forward and steers the stream there: pre_attn before
    the layer (on hidden_states at layer 0, else on the residual, reading residual + hidden);
    post_attn on the norm's residual input, reading it + the attention output; post_block
    after the layer, on its residual output (every later layer sees the delta)."""
    log: list = []
    model = fake_model(log=log)
    ops = recording_ops(log)
    wrap_sites(model, ops)
    log.clear()  # start-up asked each norm what it does with a residual
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1))
    hidden_out, residual_out = model(torch.arange(TOKENS, dtype=torch.float32), x)

    assert [name for name, *_ in log] == [
        "pre_attn@0", "layer@0", "attn@0", "norm@0", "out@0",
        "pre_attn@1", "layer@1", "attn@1", "post_attn@1", "norm@1", "out@1", "post_block@1",
        "layer@2", "attn@2", "norm@2", "out@2", "post_block@2",
        "layer@3", "attn@3", "post_attn@3", "norm@3", "out@3",
    ]
    seen = {name: tensors for name, *tensors in log}

    def delta(site: str) -> torch.Tensor:
        hook, layer = site.split("@")
        return ops[(hook, int(layer))].delta

    def called_with(name: str, first: torch.Tensor, second: torch.Tensor | None) -> None:
        """An op got ``(x, h)``, a layer ``(hidden_states, residual)``, a norm ``(x,
        residual)``."""
        got_first, got_second = seen[name]
        assert torch.equal(got_first, first), name
        assert (got_second is None) if second is None else torch.equal(got_second, second), name

    # Layer 0: residual is None, so pre_attn steers hidden_states (reading it alone).
    called_with("pre_attn@0", x, None)
    called_with("layer@0", x + delta("pre_attn@0"), None)
    called_with("norm@0", *seen["attn@0"])  # no post_attn site at layer 0
    # Layer 1: pre_attn on the residual, reading residual + hidden_states.
    hidden, residual = seen["out@0"]
    called_with("pre_attn@1", residual, hidden)
    called_with("layer@1", hidden, residual + delta("pre_attn@1"))
    attn, residual = seen["attn@1"]
    called_with("post_attn@1", residual, attn)
    called_with("norm@1", attn, residual + delta("post_attn@1"))
    hidden, residual = seen["out@1"]
    called_with("post_block@1", residual, hidden)
    called_with("layer@2", hidden, residual + delta("post_block@1"))
    # Layer 2: post_block only; layer 3: post_attn only.
    hidden, residual = seen["out@2"]
    called_with("post_block@2", residual, hidden)
    called_with("layer@3", hidden, residual + delta("post_block@2"))
    attn, residual = seen["attn@3"]
    called_with("post_attn@3", residual, attn)
    called_with("norm@3", attn, residual + delta("post_attn@3"))
    assert torch.equal(hidden_out, seen["out@3"][0])
    assert torch.equal(residual_out, seen["out@3"][1])


def test_layers_of_another_pipeline_stage_are_skipped():
    """Sites on a ``PPMissingLayer`` are not installed; the placeholders stay as they were."""
    model = fake_model(missing=(0, 2))
    layers = list(model.model.layers)
    ops = {(hook, layer): RecordingOp(f"{hook}@{layer}", [], torch.zeros(H))
           for layer in range(LAYERS) for hook in ("pre_attn", "post_attn", "post_block")}
    installed = wrap_sites(model, ops)
    assert sorted(installed) == sorted(site for site in ops if site[1] in (1, 3))
    for i in (0, 2):
        assert model.model.layers[i] is layers[i]
    for i in (1, 3):
        assert isinstance(model.model.layers[i], SteeredLayer)
        assert isinstance(layers[i].post_attention_layernorm, SteeredNorm)


class IgnoredResidualLayer(FakeDecoderLayer):
    """Takes a ``residual`` and ignores it, and adds no branch to its input: a class that a
    reading by signature would steer as a two-stream layer."""

    def forward(self, positions, hidden_states, residual):
        hidden_states = self.mlp(self.self_attn(positions, hidden_states))
        return hidden_states, residual


def test_a_layer_whose_stream_is_not_recognized_is_refused():
    """Whatever its class is called and whatever its signature says, a layer whose code does
    not add its branches to its input fails at startup naming the model class, the layer class
    and the reason, and nothing is wrapped."""
    model = type("LlamaForCausalLM", (FakeCausalLM,), {})([])
    model.model.layers = nn.ModuleList(IgnoredResidualLayer(i, []) for i in range(LAYERS))
    layers = list(model.model.layers)
    with pytest.raises(RuntimeError, match=r"does not support the model class LlamaForCausalLM: "
                       r"layer 0 \(IgnoredResidualLayer\).*does not return its input plus"):
        wrap_sites(model, recording_ops([]))
    assert list(model.model.layers) == layers


class PassingNorm(nn.Module):
    """Cohere's norm: takes ``(x, residual)`` and returns ``residual`` untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x, residual=None):
        return x / (1 + x.abs().mean(-1, keepdim=True)), residual


class ParallelLayer(FakeDecoderLayer):
    """Cohere's layout: a ``residual`` argument overwritten, attention and MLP side by side."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__(index, log)
        self.input_layernorm = PassingNorm()

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attn = self.self_attn(positions, hidden_states)
        mlp = self.mlp(hidden_states)
        hidden_states = residual + attn + mlp
        return hidden_states, residual


def test_a_parallel_layer_has_no_post_attn():
    """A layer whose norm passes the residual through and whose attention and MLP read the same
    input has no stream between them: ``pre_attn`` / ``post_block`` steer its input / output,
    ``post_attn`` stops the engine naming the layer."""
    def model():
        m = type("CohereForCausalLM", (FakeCausalLM,), {})([])
        m.model.layers = nn.ModuleList(ParallelLayer(i, []) for i in range(LAYERS))
        return m

    with pytest.raises(RuntimeError, match=r"layer 1 \(ParallelLayer: parallel attention \+ "
                       r"MLP\) has no post_attn"):
        wrap_sites(model(), {("post_attn", 1): RecordingOp("", [], torch.zeros(H))})
    gen = torch.Generator().manual_seed(7)
    deltas = {("pre_attn", 1): torch.randn(H, generator=gen),
              ("post_block", 2): torch.randn(H, generator=gen)}
    steered = model()
    wrap_sites(steered, {site: RecordingOp("", [], d) for site, d in deltas.items()})
    plain = model()
    positions = torch.arange(TOKENS, dtype=torch.float32)
    x = torch.randn(TOKENS, H, generator=gen)
    h = x
    with torch.no_grad():
        got = steered(positions, x)[0]
        for i, layer in enumerate(plain.model.layers):
            h = h + deltas.get(("pre_attn", i), 0)
            h, _ = layer(positions, h, None)
            h = h + deltas.get(("post_block", i), 0)
    torch.testing.assert_close(got, h)


def test_a_model_without_decoder_layers_is_refused():
    model = type("LlamaForCausalLM", (nn.Module,), {})()
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM keeps its decoder layers in none"):
        wrap_sites(model, recording_ops([]))


def test_install_sites_steers_each_site_from_its_own_buffers():
    """``install_sites`` puts one steering op per configured site, each reading its own rows of
    the worker's buffers: with a different global vector at every site, the steered forward
    equals the fake model with plain "add this site's vector" ops, at monitor sites (the op)
    and at the others (fused tensor ops) alike."""
    sites = resolve_sites("pre_attn@0-1,post_attn@1,post_attn@3,post_block@1-2", LAYERS)
    rng = np.random.default_rng(2)
    vectors = {site: rng.standard_normal(H).astype(np.float32) for site in sites}
    monitors = frozenset({("post_attn", 1), ("post_block", 2)})
    state = SteeringState(sites, H, max_rows=2, max_tokens=16, max_slots=2,
                          device=torch.device("cpu"), monitor_sites=monitors)
    entries = [{"vector": v.tolist(), "layers": [layer], "hook": hook}
               for (hook, layer), v in vectors.items()]
    state.set_global([entry_to_wire(e) for e in parse_entries(entries)], "g")
    state.add_request("r", 1, {GLOBAL_KEY: "g"}, prompt_len=TOKENS)
    state.fill(np.array([1]), np.array([0]), np.array([TOKENS]))

    steered = fake_model()
    installed = install_sites(steered, state.site_buffers())
    assert sorted(installed) == sorted(sites)
    layers = steered.model.layers
    assert all(isinstance(op, SiteOp) for op in (
        layers[0].pre, layers[1].pre, layers[1].post, layers[2].post,
        layers[1].layer.post_attention_layernorm.site, layers[3].post_attention_layernorm.site))
    assert [layers[1].layer.post_attention_layernorm.site.monitor, layers[2].post.monitor,
            layers[1].post.monitor] == [True, True, False]

    reference = fake_model()
    wrap_sites(reference, {site: RecordingOp("reference", [], torch.from_numpy(v))
                           for site, v in vectors.items()})
    positions = torch.arange(TOKENS, dtype=torch.float32)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(3))
    unsteered = fake_model()(positions, x)
    with torch.no_grad():
        got, want = steered(positions, x), reference(positions, x)
    torch.testing.assert_close(got, want)
    assert (got[1] - unsteered[1]).abs().max() > 0.1


class FakeEntryNormLayer(FakeDecoderLayer):
    """A layer whose input norm is vLLM's RMSNorm, called as Llama's is: ``(hidden_states,
    residual)`` from layer 1 on, the stream after the layer before first exists inside it."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__(index, log)
        self.input_layernorm = RMSNorm(H, eps=1e-5)


class FakeNormedCausalLM(FakeCausalLM):
    """Llama's outer loop: the final norm adds the last layer's two halves."""

    def forward(self, positions, x):
        hidden_states, residual = super().forward(positions, x)
        return self.model.norm(hidden_states, residual)[0]


def normed_model() -> nn.Module:
    with set_current_vllm_config(VllmConfig()):
        model = type("LlamaForCausalLM", (FakeNormedCausalLM,), {})([])
        model.model.layers = nn.ModuleList(FakeEntryNormLayer(i, []) for i in range(LAYERS))
        model.model.norm = RMSNorm(H, eps=1e-5)
    gen = torch.Generator().manual_seed(4)
    for norm in [layer.input_layernorm for layer in model.model.layers] + [model.model.norm]:
        norm.weight.data = 1 + torch.randn(H, generator=gen)
    return model


def test_post_block_runs_inside_the_norm_that_adds_its_stream():
    """Where the next layer's input norm (after the last layer: the final norm) is vLLM's
    RMSNorm, a ``post_block`` site becomes a SteeredNorm there (on CUDA: one kernel); it stays
    around its layer where the next layer has a ``pre_attn`` site. Either way the model computes
    what the sites at their places compute: the same forward as with every ``post_block`` kept
    around its layer."""
    sites = (("post_block", 0), ("pre_attn", 1), ("post_block", 1), ("post_block", 3))
    gen = torch.Generator().manual_seed(5)
    deltas = {site: torch.randn(H, generator=gen) for site in sites}
    model = normed_model()
    reference = normed_model()
    inner = list(model.model.layers)
    wrap_sites(model, {site: RecordingOp(f"{site}", [], d) for site, d in deltas.items()})
    layers = model.model.layers
    assert isinstance(layers[0], SteeredLayer) and layers[0].post is not None  # pre_attn@1
    assert isinstance(layers[1], SteeredLayer) and layers[1].post is None
    assert isinstance(inner[2].input_layernorm, SteeredNorm)
    assert isinstance(model.model.norm, SteeredNorm)
    assert layers[3] is inner[3]

    contracts = layer_contracts(reference)
    reference.model.layers = nn.ModuleList(
        SteeredLayer(layer, RecordingOp("", [], deltas[("pre_attn", i)])
                     if ("pre_attn", i) in deltas else None,
                     RecordingOp("", [], deltas[("post_block", i)])
                     if ("post_block", i) in deltas else None, contracts[i])
        for i, layer in enumerate(reference.model.layers))
    positions = torch.arange(TOKENS, dtype=torch.float32)
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, want = model(positions, x), reference(positions, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - normed_model()(positions, x)).abs().max() > 0.1


def test_post_block_stays_around_its_layer_before_another_stage():
    """The next layer on another pipeline stage: the site stays around its own layer (the
    stream leaves this stage as two halves); the final norm is not this stage's either."""
    model = normed_model()
    model.model.layers[2] = PPMissingLayer()
    model.model.norm = PPMissingLayer()
    inner = list(model.model.layers)
    wrap_sites(model, {("post_block", 1): RecordingOp("", [], torch.zeros(H)),
                       ("post_block", 3): RecordingOp("", [], torch.zeros(H))})
    assert isinstance(model.model.layers[1], SteeredLayer) and model.model.layers[1].post
    assert isinstance(model.model.layers[3], SteeredLayer) and model.model.layers[3].post
    assert not isinstance(inner[1].input_layernorm, SteeredNorm)


@pytest.mark.parametrize("projections", [0, 1])
def test_site_ops_fuse_their_norm_only_on_cuda_and_when_asked(projections):
    """A site runs in its norm's kernel on CUDA only, with ``fused_norms`` (``install_sites(...,
    fuse_norms=...)``) and without projection slots; elsewhere the site runs, then the norm."""
    sites = resolve_sites("post_block@0-1", 2)
    state = SteeringState(sites, H, max_rows=2, max_tokens=16, max_slots=2,
                          device=torch.device("cpu"), max_projections=projections)
    cpu = torch.zeros(3, H)
    cuda = SimpleNamespace(is_cuda=True, shape=(3, H))  # what fuses_norm looks at
    for fuse in (True, False):
        for op in (SiteOp(b, fuse) for b in state.site_buffers().values()):
            assert not op.fuses_norm(cpu)
            assert op.fuses_norm(cuda) is (fuse and not projections)


def test_vllm_norm_fusions_are_read_from_the_pass_config():
    """The passes that would lose their pattern to a fused site (flags a version lacks: off)."""
    passes = SimpleNamespace(fuse_allreduce_rms=True, enable_sp=False, fuse_norm_quant=None)
    assert norm_passes(passes) == ("fuse_allreduce_rms",)
    assert norm_passes(SimpleNamespace()) == ()


class FakeStreamNorm(nn.Module):
    def forward(self, x):
        return x / (1 + x.abs().mean(-1, keepdim=True))


class FakeStreamLayer(nn.Module):
    """A single-stream layer like vLLM's Granite: ``(positions, hidden_states) -> stream``,
    the mid stream is both the norm's input and the residual of the MLP add."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.input_layernorm = FakeStreamNorm()
        self.self_attn = FakeAttention(index)
        self.post_attention_layernorm = FakeStreamNorm()
        self.mlp = FakeMLP()

    def forward(self, positions, hidden_states):
        residual = hidden_states
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = residual + attn * 0.5
        residual = hidden_states
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + mlp * 0.5


def test_single_stream_layers_steer_the_stream_everywhere():
    """In a single-stream layer (Granite's contract) ``pre_attn`` / ``post_block`` steer the
    layer's input / output and ``post_attn`` the stream after attention's add, which the MLP's
    residual add sees too: the wrapped model equals the layer math with the deltas added by
    hand at those three points."""
    model = type("GraniteForCausalLM", (nn.Module,), {})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([FakeStreamLayer(0), FakeStreamLayer(1)])
    gen = torch.Generator().manual_seed(3)
    deltas = {site: torch.randn(H, generator=gen)
              for site in (("pre_attn", 0), ("post_attn", 0), ("post_attn", 1),
                           ("post_block", 1))}
    positions = torch.arange(TOKENS, dtype=torch.float32)
    x = torch.randn(TOKENS, H, generator=gen)

    def by_hand(x):
        for i in range(2):
            x = x + deltas.get(("pre_attn", i), 0)
            layer = FakeStreamLayer(i)
            attn = torch.tanh((i + 2) * layer.input_layernorm(x)) + positions[:, None]
            mid = x + attn * 0.5
            mid = mid + deltas.get(("post_attn", i), 0)
            x = mid + torch.sin(3 * layer.post_attention_layernorm(mid)) * 0.5
            x = x + deltas.get(("post_block", i), 0)
        return x

    ops = {site: RecordingOp(f"{site}", [], d) for site, d in deltas.items()}
    assert sorted(wrap_sites(model, ops)) == sorted(deltas)
    assert isinstance(model.model.layers[0], SteeredLayer)
    assert isinstance(model.model.layers[1].layer.post_attention_layernorm, SteeredInput)
    steered = x
    for layer in model.model.layers:
        steered = layer(positions, steered)
    torch.testing.assert_close(steered, by_hand(x))


class FakeStreamFirstLayer(FakeDecoderLayer):
    """GPT-OSS's argument order, ``(hidden_states, positions, residual)``; the model reads an
    attribute (``mlp``) through its layers."""

    def forward(self, hidden_states, positions, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        attn = self.self_attn(positions, residual)
        hidden_states, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(hidden_states), residual


def test_layers_taking_the_stream_first_are_steered_the_same():
    """A layer whose signature puts ``hidden_states`` before ``positions`` (GPT-OSS) is called
    in its own order and steered exactly as a ``(positions, hidden_states)`` layer; reads of
    the layer's attributes through the wrapper reach the layer."""
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(TOKENS, dtype=torch.float32)
    want = fake_model()
    wrap_sites(want, recording_ops([]))
    expected = want(positions, x)

    got = type("GptOssForCausalLM", (nn.Module,), {})()
    got.model = nn.Module()
    got.model.layers = nn.ModuleList(FakeStreamFirstLayer(i, []) for i in range(LAYERS))
    mlps = [layer.mlp for layer in got.model.layers]
    wrap_sites(got, recording_ops([]))
    assert all(layer.mlp is mlp for layer, mlp in zip(got.model.layers, mlps, strict=True))
    hidden_states, residual = x, None
    for layer in got.model.layers:
        hidden_states, residual = layer(hidden_states, positions, residual)
    torch.testing.assert_close((hidden_states, residual), expected)
