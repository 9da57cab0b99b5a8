"""Prefix caching stays on and never serves steered KV to a differently steered request.

Steered requests carry a steering fingerprint in their cache salt (vLLM chains block hashes, so
every block forks); unsteered traffic keeps sharing blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import params, run, start_llm, stop_llm
from hf_reference import load_hf, reference_logprobs
from test_steering_reference import TOL, vec

from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

BLOCK = 32
PREFILL = [{"vector": vec(51), "layers": [1, 2], "phase": "prefill"}]
GATED = {"probe": {"weights": vec(52, norm=1.0), "threshold": -1.0, "sharpness": 2.0},
         "layer": 1, "steer": [{"vector": vec(53), "layers": [2]}]}


def prompt(seed: int, n: int = 3 * BLOCK + 3) -> list[int]:
    return [1, *np.random.RandomState(seed).randint(3, 500, n - 1).tolist()]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = start_llm(tiny_model_dir("llama"), dynsteer={}, enable_prefix_caching=True,
                    block_size=BLOCK)
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf(tiny_model_dir("llama"))


def one(llm, tokens, spec=None):
    """One request without prompt logprobs (vLLM never reads the prefix cache for those)."""
    (out,) = run(llm, [tokens], [params(4, spec=spec, prompt_logprobs=None)])
    return out


def assert_matches_hf(hf, out, entries=(), gate=None):
    """Generated-token logprobs equal a cold HF run with the same steering."""
    prompt_len = len(out.prompt_token_ids)
    gen = list(out.outputs[0].token_ids)
    got = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen, strict=True)]
    tokens = list(out.prompt_token_ids) + gen
    want = reference_logprobs(hf, tokens, prompt_len, entries, gate=gate)[prompt_len - 1:]
    np.testing.assert_allclose(got, want, atol=TOL)


def test_unsteered_traffic_keeps_full_prefix_hits(llm):
    """No collateral loss: an unsteered repeat hits every full block of the first run."""
    p = prompt(1)
    assert one(llm, p).num_cached_tokens == 0
    assert one(llm, p).num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK


def test_prefill_steered_request_does_not_hit_unsteered_blocks(llm, hf):
    """Same tokens, prefill-steered: no cached blocks, logprobs equal a cold steered run."""
    p = prompt(2)
    one(llm, p)
    out = one(llm, p, {"steer": PREFILL})
    assert out.num_cached_tokens == 0
    assert_matches_hf(hf, out, PREFILL)


def test_unsteered_request_does_not_hit_steered_blocks(llm, hf):
    """KV computed under steering (static or gated) is never served to an unsteered request."""
    for i, spec in enumerate([{"steer": PREFILL}, {"gate": GATED}]):
        p = prompt(10 + i)
        one(llm, p, spec)
        out = one(llm, p)
        assert out.num_cached_tokens == 0
        assert_matches_hf(hf, out)


def test_identically_steered_requests_share_blocks(llm, hf):
    """The same spec computes the same KV, so it may be (and is) shared."""
    p = prompt(3)
    one(llm, p, {"gate": GATED})
    out = one(llm, p, {"gate": GATED})
    assert out.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
    assert_matches_hf(hf, out, gate=GATED)


def test_global_steering_forks_the_cache(llm, hf):
    """Under global steering nothing computed before is reused; after clearing, it is again."""
    p = prompt(4)
    one(llm, p)
    steering = Steering(llm)
    entries = [{"vector": vec(54), "layers": [3]}]
    steering.set_global(entries)
    try:
        out = one(llm, p)
        assert out.num_cached_tokens == 0
        assert_matches_hf(hf, out, entries)
    finally:
        steering.clear_global()
    assert one(llm, p).num_cached_tokens > 0


def test_phase_specific_steering_never_reuses_decode_kv_as_prompt(llm, hf):
    """A follow-up whose prompt is a decode-steered request's prompt + output: positions that
    were generated (decode phase) are prompt positions now, so their KV must be recomputed."""
    decode_only = {"steer": [{"vector": vec(55), "layers": [1], "phase": "decode"}]}
    p = prompt(5, n=2 * BLOCK - 2)
    (first,) = run(llm, [p], [params(8, spec=decode_only, prompt_logprobs=None)])
    follow = p + list(first.outputs[0].token_ids)
    out = one(llm, follow, decode_only)
    assert out.num_cached_tokens == 0
    assert_matches_hf(hf, out, decode_only["steer"])
