"""Steering entries that name ``positions``, and ``norm_match`` adds: the product's stretches
(``worker/position_rows.py``) without an engine, then a real engine (CPU, fp32, tiny Llama)
against the HF reference, whose position masks and norm-matched adds are written out
independently (``hf_reference._mask``, ``_norm_matched``): static adds, a clamp, generated-token
offsets, phase and positions together, a gated entry with positions, norm-matched entries
(static, and gated with positions), and a prefix-cache hit up to the first steered position."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from engine_utils import ALL_SITES, LOGPROB_ATOL, params, run, start_llm, stop_llm
from hf_reference import assert_logprobs_match_hf, load_hf, reference_logprobs
from tiny_models import HIDDEN, vec

from dynsteer.controller.positions import MAX_CUTS, intervals, steered
from dynsteer.controller.spec import (
    ModelShape,
    SpecError,
    check_entries,
    parse_entries,
    parse_spec,
)
from dynsteer.controller.wire import entry_to_wire, read_entries
from dynsteer.engine_ext.worker.position_rows import END, positioned, stretches
from dynsteer.engine_ext.worker.resolve import UNSTEERED

PROMPT = [1, *np.random.RandomState(7).randint(3, 500, 69).tolist()]
"""70 tokens: two full blocks of 32 and a partial one."""
GATE_PROBE = {"weights": vec(9, norm=1.0), "threshold": -1e4, "sharpness": 1.0}

CASES = {
    "indices and ranges": [{"vector": vec(1), "layers": [1], "positions": [2, "4:7", -1]}],
    "generated offsets": [{"vector": vec(2), "layers": [2], "hook": "pre_attn",
                           "positions": ["g1:g3"]},
                          {"vector": vec(3), "layers": [0], "hook": "post_attn",
                           "positions": "last_prompt"}],
    "phase and positions": [{"vector": vec(4), "layers": [1, 3], "phase": "decode",
                             "positions": ["-3:"]},
                            {"vector": vec(5), "layers": [1], "positions": [":3"]}],
    "clamp": [{"vector": vec(6), "layers": [1, 2], "op": "clamp", "value": 8.0,
               "positions": ["9:g2"]}],
    "norm_match": [{"vector": vec(10), "layers": [1, 3], "scale": 0.6, "norm_match": True},
                   {"vector": vec(12), "layers": [0], "hook": "pre_attn"}],
}
GATED = {"probe": GATE_PROBE, "layer": 1,
         "steer": [{"vector": vec(8), "layers": [2, 3], "positions": ["-2:g1"]},
                   {"vector": vec(11), "layers": [3], "hook": "pre_attn", "scale": -0.5,
                    "norm_match": True, "positions": ["g0:"]}]}


def wire_of(entries, gate=None):
    spec = parse_spec({"steer": entries, **({"gate": gate} if gate else {})})
    return {"steer": [entry_to_wire(e) for e in spec.steer], "key": "k",
            "gate": None if gate is None else {"steer": [entry_to_wire(e)
                                                         for e in spec.gate.steer]}}


def test_intervals_read_every_form():
    assert intervals([2, "4:7", -1, "g1", "g3:g5", "g0"], 10, 100) == [
        (2, 3), (4, 7), (9, 12), (13, 15)]
    assert intervals([":2", "-2:"], 10, 12) == [(0, 2), (8, 12)]
    assert steered(["5:"], "decode", 10, 20) == [(10, 20)]
    assert steered("last_prompt", "decode", 10, 20) == []


def test_stretches_cut_where_the_active_entries_change():
    seen = []
    parts = stretches(wire_of(CASES["phase and positions"]), 10,
                      lambda w: seen.append(w) or UNSTEERED)
    # ":3" (entry 1) on 0..2, nothing on 3..9, "-3:" within decode (entry 0) from 10 on.
    assert [(p.start, p.phase, p.key) for p in parts] == [
        (0, "prefill", "k|p1"), (3, "prefill", "k|p"), (10, "decode", "k|p0")]
    assert [len(w["steer"]) for w in seen] == [1, 0, 1]
    assert all(e[2] == "all" and e[7] is None for w in seen for e in w["steer"])
    assert not positioned(wire_of([{"vector": vec(1), "layers": [1]}]))
    # A session's entries joined to a request's may cut more than one spec may: refused here
    # (the request then runs unsteered), never past the slot table's stretches.
    crowded = wire_of([{"vector": vec(1), "layers": [1], "positions": list(range(0, 60, 3))}])
    crowded["steer"] = [[*crowded["steer"][0][:7], list(range(i, 100, 3))] for i in range(3)]
    assert read_entries(crowded["steer"])[0].norm_match is False  # an absent field's default
    with pytest.raises(ValueError, match="stretches of positions, more than 66"):
        stretches(crowded, 120, lambda w: UNSTEERED)
    assert END > 2**30


def test_bad_positions_are_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"steer\[0\]\.positions"):
        parse_spec({"steer": [{"vector": vec(1), "layers": [1], "positions": ["x:y"]}]})
    many = [{"vector": vec(1), "layers": [1], "positions": list(range(0, 200, 2))}]
    with pytest.raises(SpecError, match=f"more than {MAX_CUTS} stretches"):
        parse_spec({"steer": many})
    with pytest.raises(SpecError, match=r"steer\[0\]\.positions: global steering has no "
                                        r"prompt"):
        parse_entries([{"vector": vec(1), "layers": [1], "positions": [3]}], "steer",
                      positioned=False)


def test_bad_norm_match_entries_are_refused_naming_the_field():
    shape = ModelShape(hidden_size=HIDDEN, num_layers=4, sites=frozenset({("post_block", 1)}),
                       max_projections=1)
    with pytest.raises(SpecError, match=r"steer\[0\]: norm_match is for op 'add'"):
        parse_spec({"steer": [{"vector": vec(1), "layers": [1], "op": "ablate",
                               "norm_match": True}]})
    for entry, message, slots in [
            ({"scale": 65.0}, r"steer\[0\]\.scale: 65.0 times the stream's norm; at most 64", 1),
            ({}, r"steer\[0\]\.norm_match: norm_match needs the engine option "
                 r"dynsteer.max_projections", 0),
            ({"vector": [0.0] * HIDDEN}, r"steer\[0\]\.vector: norm_match acts along", 1)]:
        spec = parse_spec({"steer": [{"vector": vec(1), "layers": [1], "norm_match": True,
                                      **entry}]})
        with pytest.raises(SpecError, match=message):
            check_entries(spec.steer, replace(shape, max_projections=slots), "steer")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = start_llm(path, block_size=32, enable_prefix_caching=True,
                    dynsteer={"sites": ALL_SITES, "monitor_sites": "post_block@1",
                              "max_projections": 1}, in_process=True)
    try:
        yield llm, load_hf(path)
    finally:
        stop_llm(llm)


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_positioned_entries_match_hf(engine, case):
    """Prompt and generated logprobs equal HF's with the same entries at the same positions,
    and the steering is strong enough to be seen."""
    llm, hf = engine
    out, = run(llm, [PROMPT[:12]], [params(6, spec={"steer": CASES[case]})])
    tokens, want, _ = assert_logprobs_match_hf(hf, out, CASES[case])
    unsteered = reference_logprobs(hf, tokens, len(out.prompt_token_ids))
    assert np.abs(want - unsteered).max() > 20 * LOGPROB_ATOL, "steering too weak to be checked"


@pytest.mark.engine
def test_a_gated_entry_with_positions_matches_hf(engine):
    llm, hf = engine
    out, = run(llm, [PROMPT[:12]], [params(6, spec={"gate": GATED})])
    tokens, want, _ = assert_logprobs_match_hf(hf, out, gate=GATED)
    unsteered = reference_logprobs(hf, tokens, len(out.prompt_token_ids))
    assert np.abs(want - unsteered).max() > 20 * LOGPROB_ATOL


@pytest.mark.engine
def test_the_cache_is_shared_up_to_the_first_steered_position(engine):
    """A prompt served unsteered leaves its blocks cached; a request that steers it from
    position 40 on reuses the block before that position's (32 tokens) and computes the
    rest, matching HF; one steering only generated tokens reuses both full blocks."""
    llm, hf = engine
    plain = params(4, prompt_logprobs=None)
    run(llm, [PROMPT], [plain])
    entries = [{"vector": vec(1), "layers": [1, 2], "positions": ["40:"]}]
    out, = run(llm, [PROMPT], [params(4, spec={"steer": entries}, prompt_logprobs=None)])
    assert out.num_cached_tokens == 32
    assert_logprobs_match_hf(hf, out, entries)
    late = [{"vector": vec(2), "layers": [1], "positions": ["g1:"]}]
    out, = run(llm, [PROMPT], [params(4, spec={"steer": late}, prompt_logprobs=None)])
    assert out.num_cached_tokens == 64
    assert_logprobs_match_hf(hf, out, late)
