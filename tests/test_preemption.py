"""A steered request that is preempted and recomputed keeps its steering (tiny KV cache), and
a request capturing its activations gets every position's row once, as HF computes it."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import params, run, start_llm, stop_llm
from hf_reference import CAPTURE_ATOL, assert_logprobs_match_hf, load_hf, record_streams
from tiny_models import vec

from dynsteer.engine_ext import Steering

pytestmark = pytest.mark.engine

BLOCK = 32
CAPTURE = {"sites": ["post_block@0", "post_block@2"]}
SPECS = [
    {"steer": [{"vector": vec(61), "layers": [1], "phase": "prefill"},
               {"vector": vec(62), "layers": [2], "phase": "decode"}], "capture": CAPTURE},
    None,
    {"gate": {"probe": {"weights": vec(63, norm=1.0), "threshold": 0.0, "sharpness": 2.0},
              "layer": 0, "steer": [{"vector": vec(64), "layers": [0, 2]}]}, "capture": CAPTURE},
    {"steer": [{"vector": vec(65), "layers": [3]}]},
]


@pytest.fixture(scope="module")
def preempted_outputs(tiny_model_dir):
    path = tiny_model_dir("llama")
    # 6 blocks of 32 tokens for 4 requests of 40 + 40 tokens: the scheduler must preempt.
    llm = start_llm(path, dynsteer={"monitor_sites": "post_block@0,post_block@2"},
                    block_size=BLOCK,
                    num_gpu_blocks_override=6,
                    max_model_len=128, max_num_seqs=4, disable_log_stats=False,
                    in_process=True)
    try:
        prompts = [[1, *np.random.RandomState(i).randint(3, 500, 39).tolist()] for i in range(4)]
        outs = run(llm, prompts, [params(40, spec=s) for s in SPECS])
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")
        steering = Steering(llm)
        captured = [steering.activations(out) for out in outs]
    finally:
        stop_llm(llm)
    return load_hf(path), outs, preemptions, captured


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_outputs_match_hf_despite_preemption(preempted_outputs, i):
    hf, outs, _, _ = preempted_outputs
    spec = SPECS[i] or {}
    assert_logprobs_match_hf(hf, outs[i], spec.get("steer", []), gate=spec.get("gate"))


@pytest.mark.parametrize("i", [0, 2])
def test_captured_rows_match_hf_despite_preemption(preempted_outputs, i):
    """Every position 0..78 once (none lost or repeated by the recompute), equal to HF's."""
    hf, outs, _, captured = preempted_outputs
    out, acts = outs[i], captured[i]
    assert acts.status == "ok", acts.detail
    assert acts.positions.tolist() == list(range(79))
    tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
    streams = record_streams(hf, tokens, SPECS[i].get("steer", ()), gate=SPECS[i].get("gate"),
                             prompt_len=len(out.prompt_token_ids))
    for site in CAPTURE["sites"]:
        layer = int(site.split("@")[1])
        np.testing.assert_allclose(acts[site], streams[("post_block", layer)],
                                   atol=CAPTURE_ATOL, err_msg=site)
    assert captured[1] is None and captured[3] is None


def test_the_scheduler_did_preempt(preempted_outputs):
    """Guard: the cache is small enough that requests were really preempted and recomputed."""
    assert preempted_outputs[2] > 0
