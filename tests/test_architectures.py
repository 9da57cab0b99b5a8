"""Every supported architecture beyond Llama / Qwen2 / Qwen3 matches HF transformers: Mistral,
Phi-3 (fused projections), Granite (multipliers, single-stream layers), Gemma 2 (soft-capping)
and Gemma 3 text (extra norms, scaled embeddings), and the mixture-of-experts Qwen3-MoE,
Mixtral and GPT-OSS (attention sinks, alternating sliding windows, its own argument order),
and the rest of ``census.VERIFIED``: OLMo 3, GPT-NeoX and Phi-2 run through vLLM's
Transformers backend (HF's own layers, with a batch dimension); GPT-NeoX and Phi are parallel
(no ``post_attn``: :func:`without_post_attn`).

One engine per architecture (compiled: Dynamo, and Inductor for :data:`INDUCTOR`; fp32, CPU
build; run in the test's process, ``engine_utils.InProcessEngine``, as nearly all of its time is
its start), every hook at every layer, in one batch: the baseline, static steering at every hook
and phase (``tiny_models.STATIC_CASES``), gated steering (the cases of
``test_gating_reference``: monitors at all three hooks through the op, gated sites after them
through the fused add, registered and inline probes), then activation capture at the monitor
sites. What each hook means per architecture is in the
table of docs/architectures.md and ``hf_reference.attention_branch``. An architecture without
a verified layer contract fails at engine startup with a message naming its class.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import pytest
from engine_utils import (
    ALL_SITES,
    LOGPROB_ATOL,
    params,
    run,
    start_llm,
    stop_llm,
    without_inductor,
)
from hf_reference import (
    assert_capture_matches_hf,
    assert_logprobs_match_hf,
    load_hf,
    record_streams,
    reference_logprobs,
)
from test_gating_reference import (
    MAX_TOKENS,
    MONITOR_SITES,
    PROMPT,
    assert_gated_matches_hf,
    base_cases,
    calibrate,
    register_probes,
)
from tiny_models import STATIC_CASES, make_tiny_model

from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

ARCHS = ["mistral", "phi3", "granite", "gemma2", "gemma3", "qwen3_moe", "mixtral", "gpt_oss",
         "gemma", "olmoe", "nemotron", "ernie4_5", "ernie4_5_moe", "glm4_moe", "granitemoe",
         "granitemoeshared", "stablelm", "deepseek_v2", "glm4", "exaone4",
         "qwen2_moe", "llama4", "apertus", "ministral3", "afmoe", "granitemoehybrid", "gpt2",
         "opt", "olmo3", "gpt_neox", "phi", "cohere"]
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 300, 5, 77, 8]]
GATED = list(base_cases())
DAMPED = {"glm4", "exaone4", "afmoe"}
"""HF model types whose norms after attention and MLP shrink what a decode-phase delta at a
later layer changes: their gated cases need only move a logprob by 4 tolerances (not 20)."""
ENGINE_ARGS = {"deepseek_v2": {"attention_backend": "CPU_MLA"}}
"""Engine arguments by architecture: DeepSeek's MLA on the reference CPU kernel (on a host
with AMX, vLLM picks its AMX kernel, which takes 16-bit weights only, for this fp32 model)."""
INDUCTOR = {"granite", "exaone4", "gpt_neox"}
"""Architectures whose engine runs Inductor-compiled: one per way a site enters a layer beyond
Llama's fused add + norm (which ``test_steering_reference`` and its siblings run compiled): a
module's input steered in place and steering around a single-stream layer (Granite), the same
in a post-norm layer, whose steered module is the MLP (Exaone 4), and a model of vLLM's
Transformers backend (GPT-NeoX). The others check where each class's hooks sit, which Dynamo's
trace run without Inductor shows at half the start-up (``engine_utils.without_inductor``)."""
PARALLEL = {"gpt_neox", "phi", "cohere"}
"""Architectures whose layers run attention and MLP side by side: no ``post_attn``, so every
case's ``post_attn`` entry, site and probe is moved to ``pre_attn`` of the same layer."""


def without_post_attn(value):
    """``value`` (a spec, a case table, a site list) with ``post_attn`` replaced by
    ``pre_attn``: the same cases for a layout without ``post_attn``."""
    if isinstance(value, dict):
        return {k: without_post_attn(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_post_attn(v) for v in value]
    if isinstance(value, str):
        return value.replace("post_attn", "pre_attn")
    return value


class ArchRun(NamedTuple):
    hf: Any
    gated: dict
    static: dict
    monitors: str
    outs: dict
    telemetry: dict
    capture: dict
    refusal: str | None
    """A layout without ``post_attn``: the error of a request that asks for it."""


@pytest.fixture(scope="module", params=ARCHS)
def arch_run(request, tiny_model_dir) -> ArchRun:
    """(HF model, the gated specs, outputs by case name, telemetry, capture, streams) of one
    architecture's engine, stopped before the tests read them."""
    path = tiny_model_dir(request.param)
    hf = load_hf(path)
    layout = without_post_attn if request.param in PARALLEL else (lambda value: value)
    gated = {name: calibrate(hf, spec) for name, spec in layout(base_cases()).items()}
    static = layout(STATIC_CASES)
    monitors = layout(MONITOR_SITES)
    specs = {"baseline": None, **{n: {"steer": e} for n, e in static.items()}, **gated}
    prompts = [PROMPTS[i % 2] for i in range(1 + len(static))] + [PROMPT] * len(gated)
    with nullcontext() if request.param in INDUCTOR else without_inductor():
        llm = start_llm(path, dynsteer={"sites": layout(ALL_SITES), "monitor_sites": monitors},
                        in_process=True, **ENGINE_ARGS.get(request.param, {}))
    try:
        steering = Steering(llm)
        register_probes(steering)
        refusal = None
        if request.param in PARALLEL:
            with pytest.raises(ValueError) as refused:
                run(llm, [PROMPT], [params(1, spec={"steer": STATIC_CASES["post_attn-all"]})])
            refusal = str(refused.value)
        outs = dict(zip(specs, run(llm, prompts, [params(MAX_TOKENS, spec=s)
                                                  for s in specs.values()]), strict=True))
        telemetry = {n: steering.telemetry(outs[n]) for n in gated}
        capture = steering.capture(PROMPTS, monitors, reduce="all")
    finally:
        stop_llm(llm)
    return ArchRun(hf, gated, static, monitors, outs, telemetry, capture, refusal)


def test_baseline_matches_hf(arch_run):
    """With the plugin on and no steering, logprobs equal HF's."""
    assert_logprobs_match_hf(arch_run.hf, arch_run.outs["baseline"])


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_steering_matches_hf(arch_run, case):
    """Every hook and phase: prompt and generated logprobs equal the HF hook reference."""
    hf, out = arch_run.hf, arch_run.outs[case]
    tokens, want, _ = assert_logprobs_match_hf(hf, out, arch_run.static[case])
    unsteered = reference_logprobs(hf, tokens, len(out.prompt_token_ids))
    assert np.abs(want - unsteered).max() > 20 * LOGPROB_ATOL, "steering too weak to be checked"


@pytest.mark.parametrize("case", GATED)
def test_gated_steering_matches_hf(arch_run, case):
    """Gated steering equals HF's, and the traced gates are HF's gates."""
    hf = arch_run.hf
    strength = 4 if hf.config.model_type in DAMPED else 20
    tokens, gates = assert_gated_matches_hf(hf, arch_run.gated[case], arch_run.outs[case],
                                            strength)
    traced = arch_run.telemetry[case]["gates"]
    if traced:
        np.testing.assert_allclose(np.array(traced[: len(tokens) - 1], dtype=np.float64),
                                   gates[: len(tokens) - 1], atol=5e-3)


def test_capture_matches_hf(arch_run):
    """The stream captured at each monitor site (one per hook) equals HF's."""
    capture = arch_run.capture
    assert set(capture) == set(arch_run.monitors.split(","))
    assert_capture_matches_hf(capture, [record_streams(arch_run.hf, p) for p in PROMPTS], "all")


def test_a_request_for_a_hook_the_layers_lack_is_refused_naming_the_layer(arch_run):
    """In a layout without ``post_attn`` a request asking for it is refused at admission
    naming the layer, its class and layout, and the hooks it has (the engine keeps serving:
    the fixture's later requests ran after it)."""
    parallel = arch_run.hf.config.model_type in PARALLEL
    assert (arch_run.refusal is not None) == parallel
    if parallel:
        assert re.search(r"steer\[0\]\.layers: post_attn@1 does not exist: layer 1 \(\w+: "
                         r"[^)]*parallel attention \+ MLP\) has no post_attn; steer pre_attn or "
                         r"post_block of that layer instead", arch_run.refusal), arch_run.refusal


def test_a_hook_a_layer_does_not_have_stops_startup_naming_the_layer(tmp_path):
    """Cohere's layers run attention and MLP side by side (its norm passes the residual it is
    handed through): there is no stream between them, so ``post_attn`` stops the engine's
    startup with a message naming the layer and its layout (the worker's error, raised here
    as the engine runs in this process)."""
    path = make_tiny_model("cohere", tmp_path / "cohere")
    with pytest.raises(RuntimeError, match=re.escape(
            "layer 1 (CohereDecoderLayer: parallel attention + MLP) has no post_attn")):
        start_llm(path, dynsteer={"sites": "post_attn@1"}, in_process=True)
