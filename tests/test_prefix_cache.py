"""Prefix caching stays on and never serves steered KV to a differently steered request.

Steered requests fork their block hashes from the block holding their first steered position
(vLLM chains block hashes, so every later block forks too). Gated requests are keyed by their
gate and share blocks with requests of the same key, whether or not the gate fired; a gate under
a controller caches only blocks the workers reported free of dynamic steering. Unsteered traffic
keeps sharing blocks. Every reuse is checked against HF transformers computing it all.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import assert_same_output, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf
from tiny_models import vec

from dynsteer.engine_ext import Steering
from dynsteer.engine_ext.worker.telemetry import DYNAMIC_EPSILON

pytestmark = pytest.mark.engine

BLOCK = 32
SEED = 1234
PREFILL = [{"vector": vec(51), "layers": [1, 2], "phase": "prefill"}]
GATED = {"probe": {"weights": vec(52, norm=1.0), "threshold": -1.0, "sharpness": 2.0},
         "layer": 1, "steer": [{"vector": vec(53), "layers": [2]}]}
GATED_CLAMP = {**GATED, "steer": [{"vector": vec(58), "layers": [2], "op": "clamp",
                                   "value": 5.0}]}
"""A gate whose only steering is a projection (issue 17): dynamic steering like an add."""


def prompt(seed: int, n: int = 3 * BLOCK + 3) -> list[int]:
    return [1, *np.random.RandomState(seed).randint(3, 500, n - 1).tolist()]


DYNSTEER = {"sites": "pre_attn@0,post_block@*", "monitor_sites": "pre_attn@0,post_block@1",
            "max_projections": 1}
"""The engine options (the gates here read pre_attn@0 and post_block@1; one projection slot
per site for the ``clamp`` cases)."""


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = start_llm(tiny_model_dir("llama"), dynsteer=DYNSTEER, enable_prefix_caching=True,
                    block_size=BLOCK, in_process=True)
    yield llm
    stop_llm(llm)


def one(llm, tokens, spec=None, max_tokens=4, cache_salt=None, seed=None):
    """One request without prompt logprobs (vLLM never reads the prefix cache for those);
    greedy, or sampled at temperature 1 with ``seed``."""
    prompt = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    sp = params(max_tokens, spec=spec, prompt_logprobs=None)
    if seed is not None:
        sp.temperature, sp.seed = 1.0, seed
    (out,) = llm.generate([prompt], [sp], use_tqdm=False)
    return out


def test_unsteered_traffic_keeps_full_prefix_hits(llm):
    """No collateral loss: an unsteered repeat hits every full block of the first run."""
    p = prompt(1)
    assert one(llm, p).num_cached_tokens == 0
    assert one(llm, p).num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK


def test_prefill_steered_request_does_not_hit_unsteered_blocks(llm, hf_llama):
    """Same tokens, prefill-steered: no cached blocks, logprobs equal a cold steered run."""
    p = prompt(2)
    one(llm, p)
    out = one(llm, p, {"steer": PREFILL})
    assert out.num_cached_tokens == 0
    assert_logprobs_match_hf(hf_llama, out, PREFILL)


def test_unsteered_request_does_not_hit_steered_blocks(llm, hf_llama):
    """KV computed under steering (static or gated) is never served to an unsteered request."""
    for i, spec in enumerate([{"steer": PREFILL}, {"gate": GATED}, {"gate": GATED_CLAMP}]):
        p = prompt(10 + i)
        one(llm, p, spec)
        out = one(llm, p)
        assert out.num_cached_tokens == 0
        assert_logprobs_match_hf(hf_llama, out)


def test_identically_steered_requests_share_blocks(llm, hf_llama):
    """The same spec computes the same KV, so it may be (and is) shared: static entries, a gate
    that never fired, and a gate that fired (its value at a position is a function of the
    tokens up to it and of the spec, all in the key)."""
    quiet = {**GATED, "probe": {**GATED["probe"], "threshold": 1e6}}
    for i, spec in enumerate([{"steer": PREFILL}, {"gate": quiet}, {"gate": GATED},
                              {"gate": GATED_CLAMP}]):
        p = prompt(30 + i)
        one(llm, p, spec)
        out = one(llm, p, spec)
        assert out.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK, spec
        assert_logprobs_match_hf(hf_llama, out, spec.get("steer", ()), gate=spec.get("gate"))


def test_a_gate_with_another_threshold_misses_the_gated_blocks(llm, hf_llama):
    p = prompt(35)
    one(llm, p, {"gate": GATED})
    other = {**GATED, "threshold": 0.5}
    out = one(llm, p, {"gate": other})
    assert out.num_cached_tokens == 0
    assert_logprobs_match_hf(hf_llama, out, gate=other)


def test_global_steering_forks_the_cache(llm, hf_llama):
    """Under global steering nothing computed before is reused; after clearing, it is again."""
    p = prompt(4)
    one(llm, p)
    steering = Steering(llm)
    entries = [{"vector": vec(54), "layers": [3]}]
    steering.set_global(entries)
    try:
        out = one(llm, p)
        assert out.num_cached_tokens == 0
        assert_logprobs_match_hf(hf_llama, out, entries)
    finally:
        steering.clear_global()
    assert one(llm, p).num_cached_tokens > 0


def test_a_request_in_flight_keeps_the_global_steering_it_was_admitted_under(llm, hf_llama):
    """Global steering changes while a request generates: the request keeps the global
    steering it was admitted under to its end (logprobs equal HF steered by that alone), and
    its blocks are keyed by it: a request admitted under the new global steering whose prompt
    is the first one's prompt + output hits none of them, one under the old hits them all."""
    p = prompt(9, n=BLOCK + 3)
    old = [{"vector": vec(60), "layers": [3]}]
    new = [{"vector": vec(61), "layers": [1, 3]}]
    steering = Steering(llm)
    steering.set_global(old)
    try:
        engine = llm.llm_engine
        engine.add_request("in-flight", {"prompt_token_ids": p}, params(2 * BLOCK))
        finished, steps = [], 0
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
            steps += 1
            if steps == 4:
                steering.set_global(new)
        assert steps > 8, "the change must come while the request is generating"
        (out,) = finished
        assert_logprobs_match_hf(hf_llama, out, old)
        follow = p + list(out.outputs[0].token_ids)
        assert one(llm, follow).num_cached_tokens == 0
        steering.set_global(old)
        assert one(llm, follow).num_cached_tokens == (len(follow) - 1) // BLOCK * BLOCK
    finally:
        steering.clear_global()


def test_phase_specific_steering_never_reuses_decode_kv_as_prompt(llm, hf_llama):
    """A follow-up whose prompt is a decode-steered request's prompt + output: positions that
    were generated (decode phase) are prompt positions now, so their KV must be recomputed;
    the blocks before the first generated position were computed unsteered and are shared."""
    decode_only = {"steer": [{"vector": vec(55), "layers": [1], "phase": "decode"}]}
    p = prompt(5, n=2 * BLOCK - 2)
    (first,) = run(llm, [p], [params(8, spec=decode_only, prompt_logprobs=None)])
    follow = p + list(first.outputs[0].token_ids)
    out = one(llm, follow, decode_only)
    assert out.num_cached_tokens == len(p) // BLOCK * BLOCK
    assert_logprobs_match_hf(hf_llama, out, decode_only["steer"])


def test_decode_only_steering_does_not_fork_prompt_blocks(llm, hf_llama):
    """Decode-only steering leaves the prompt unsteered: its blocks are shared both ways with
    unsteered requests, while the blocks holding generated (steered) positions are not."""
    decode_only = {"steer": [{"vector": vec(56), "layers": [2], "phase": "decode"}]}
    p = prompt(6, n=3 * BLOCK + 5)
    one(llm, p)
    steered = one(llm, p, decode_only, max_tokens=40)
    assert steered.num_cached_tokens == len(p) // BLOCK * BLOCK
    assert_logprobs_match_hf(hf_llama, steered, decode_only["steer"])
    follow = p + list(steered.outputs[0].token_ids)
    out = one(llm, follow)
    assert out.num_cached_tokens == len(p) // BLOCK * BLOCK  # not the steered decode blocks
    assert_logprobs_match_hf(hf_llama, out)


def _firing_gate(llm, hf_llama, p, max_tokens, steer):
    """A gate over ``steer`` that fires first at a chosen decode position: monitor
    ``pre_attn@0`` (the token embedding) with the embedding of a token that first appears
    there as the probe."""
    plain = one(llm, p, max_tokens=max_tokens, seed=SEED)
    tokens = p + list(plain.outputs[0].token_ids)
    fresh = [t for t in range(len(p) + 1, len(tokens) - 1) if tokens[t] not in tokens[:t]]
    assert fresh, "no novel generated token to gate on"
    pos = next((t for t in fresh if 2 * BLOCK <= t < 3 * BLOCK), fresh[0])
    embed = hf_llama.get_input_embeddings().weight[tokens[pos]].detach().double().numpy()
    norm2 = float(embed @ embed)
    gate = {"probe": {"weights": embed.tolist(), "threshold": norm2 / 2,
                      "sharpness": 50.0 / norm2},
            "layer": 0, "hook": "pre_attn", "trace": True,
            "steer": steer}
    return pos, gate


@pytest.mark.parametrize("steer", [
    [{"vector": vec(57), "layers": [2]}],
    [{"vector": vec(59), "layers": [1, 2], "op": "ablate"}],
], ids=["add", "ablate"])
def test_a_conversation_resent_after_its_gate_fired_hits_every_block(llm, hf_llama, steer):
    """The gate fires first at decode position ``pos``; the next turn (the first request's
    prompt + output, same gate) is served from every full block the first request computed,
    those after ``pos`` included, and generates what HF computes from scratch. The same for a
    gate whose steering is a projection (an ``ablate`` entry)."""
    p = prompt(7 if steer[0].get("op") is None else 8, n=2 * BLOCK - 4)
    pos, gate = _firing_gate(llm, hf_llama, p, max_tokens=48, steer=steer)
    spec = {"gate": gate}
    first = one(llm, p, spec, max_tokens=48, seed=SEED)
    gates = Steering(llm).telemetry(first)["gates"]
    assert gates[pos] > 0.5
    follow = p + list(first.outputs[0].token_ids)
    warm = one(llm, follow, spec, max_tokens=6)
    assert warm.num_cached_tokens == (len(follow) - 1) // BLOCK * BLOCK > pos
    assert_logprobs_match_hf(hf_llama, warm, gate=gate)
    cold = one(llm, follow, spec, max_tokens=6, cache_salt="cold-run")
    assert cold.num_cached_tokens == 0
    assert_same_output(warm, cold)


def test_a_controlled_gate_caches_only_blocks_before_its_first_dynamic_position(llm, hf_llama):
    """Under a controller (``latch``: once latched, every later token is steered fully) the
    steering depends on more than the prefix: a follow-up with the same spec hits exactly the
    blocks before the one holding the first dynamically steered position ``pos``."""
    steer = [{"vector": vec(57), "layers": [2]}]
    p = prompt(12, n=2 * BLOCK - 4)
    pos, gate = _firing_gate(llm, hf_llama, p, max_tokens=48, steer=steer)
    spec = {"gate": gate, "controller": {"name": "latch", "k": 1}}
    withheld_before = Steering(llm).cache_stats()["blocks_withheld"]
    first = one(llm, p, spec, max_tokens=48, seed=SEED)
    gates = Steering(llm).telemetry(first)["gates"]
    assert all(g is None or g < DYNAMIC_EPSILON for g in gates[:pos]) and gates[pos] > 0.5
    assert Steering(llm).cache_stats()["blocks_withheld"] > withheld_before
    follow = p + list(first.outputs[0].token_ids)
    warm = one(llm, follow, spec, max_tokens=6)
    assert warm.num_cached_tokens == pos // BLOCK * BLOCK
    cold = one(llm, follow, spec, max_tokens=6, cache_salt="cold-run")
    assert_same_output(warm, cold)
