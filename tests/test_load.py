"""Reliability under load, CI-sized (issue 16; the full runs are ``benchmarks/load_test.py``).

One `dynsteer serve` of the tiny chat model with a KV cache of 16 blocks of 32 tokens (the
scheduler preempts under this traffic) and 8 probe rows takes 200 requests from 24 concurrent
clients, streaming and not, mixing plain, static (inline floats and base64), named, gated
(registered and inline probes), ``latch`` and session requests, while a thread registers,
replaces and deletes vectors and probes and sets and clears session steering over the command
socket. Then plain requests are sent again alone and compared with themselves under load, and
a 500-request soak drops a quarter of its requests part way (closed streams, cancelled
requests). Everything the stream sends and judges is ``load_test``'s, so the benchmark and
this test check the same things. The last test pins a bug the load found: a request admitted
naming a vector deleted while it waited in the queue ran unsteered (requests now carry the
registry generation they were admitted under; ``test_row_budget`` checks it deterministically).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import load_test as lt
import numpy as np
import pytest
from server_utils import Server, http

from dynsteer.controller.client import DynsteerClient

pytestmark = pytest.mark.engine

REQUESTS = 200
CONCURRENCY = 24
SOAK = 500
SAMPLE = 24
TOLERANCE = lt.DEFAULT_TOLERANCE
"""|Δ logprob| allowed between a plain request under load and alone (1e-4). Measured on the
tiny fp32 model: 0 (bit-identical) for 40 of 40 plain requests at 32-way load on `dynsteer
serve` and on plugin-free vLLM alike, and for 24 of 24 on this test's server (batches of up
to 16, preemptions); a steering vector of norm 4 at one layer moves the same prompts' logprobs
by 1e-2 and more (checked below, per run, against ``STEERED_MARGIN``)."""
STEERED_MARGIN = 10.0
"""The weakest steering must exceed the tolerance by this factor, or the comparison could not
see a leak."""


@pytest.fixture(scope="module")
def served(chat_model, tmp_path_factory) -> Any:
    """(server, command socket, model shape): one server for the module."""
    folder = tmp_path_factory.mktemp("load")
    own, commands = lt.dynsteer_args(folder, engine={"max_gates": lt.PROBE_CHECK})
    server = Server(chat_model, folder / "serve.log", "--max-num-seqs", "16",
                    "--block-size", "32", "--num-gpu-blocks-override", "16",
                    "--served-model-name", lt.SERVED, *own)
    try:
        server.wait_ready()
        shape = lt.Shape.of(chat_model)
        lt.register_fixtures(server.url, shape)
        yield server, commands, shape
    finally:
        server.stop()


@pytest.fixture(scope="module")
def load_run(served) -> dict[str, Any]:
    """The mixed load with churn, and the idle state before and after it."""
    server, commands, shape = served
    baseline = lt.idle_state(lt.wait_idle(server.url))
    items = lt.build_workload(REQUESTS, shape, seed=3)
    with lt.Churn(server.url, shape, commands, period_s=0.2) as churn:
        outcomes, wall = asyncio.run(lt.drive(server.url, items, CONCURRENCY, churn.spec))
    after = lt.idle_state(lt.wait_idle(server.url))
    return {"items": items, "outcomes": outcomes, "summary": lt.summarize(outcomes, wall),
            "baseline": baseline, "after": after, "churn": churn}


def test_mixed_load_is_served_without_errors(served, load_run):
    summary, outcomes = load_run["summary"], load_run["outcomes"]
    assert summary["http_5xx"] == 0, summary["first_errors"]
    assert summary["transport_errors"] == 0, summary["first_errors"]
    assert summary["malformed_or_unexpected"] == 0, summary["first_errors"]
    # Every kind of request ran, streaming and not, and completed well formed (only churn
    # requests naming a just-deleted vector or probe may be refused).
    completed = {(o.kind, o.stream) for o in outcomes if o.error is None and not o.rejected}
    assert completed == {(kind, stream) for kind in set(lt.KIND_MIX)
                         for stream in (False, True)}
    assert summary["completed"] + summary["expected_4xx"] == REQUESTS
    assert summary["expected_4xx"] < REQUESTS // 20
    assert served[0].proc.poll() is None


def test_registry_and_sessions_churned_during_the_run(load_run):
    churn = load_run["churn"]
    assert churn.failures == []
    for op in ("register_vector", "register_probe", "delete_vector", "delete_probe",
               "set_session", "clear_session"):
        assert churn.ops[op] >= 2, dict(churn.ops)


def test_rows_and_live_requests_return_to_idle(load_run):
    assert load_run["after"] == load_run["baseline"]
    assert load_run["after"]["dynsteer_steered_requests_live"] == 0


def test_plain_requests_under_load_equal_themselves_alone(served, load_run):
    """No steering leaks into plain requests: each sampled plain request's first logprobs
    equal those of the same request sent alone (within vLLM's own batch variance), while the
    same prompts steered by a norm-4 vector differ by far more than the tolerance."""
    server, _, shape = served
    items, outcomes = load_run["items"], load_run["outcomes"]
    sample = lt.leak_sample(items, outcomes, SAMPLE)
    assert len(sample) == SAMPLE
    vector = lt.unit(np.random.default_rng(17), shape.hidden, lt.VECTOR_NORM)
    control = {"steer": [{"vector": vector.tolist(), "layers": [shape.monitor]}]}
    leak = asyncio.run(lt.compare_alone(server.url, items, outcomes, sample, 8, TOLERANCE,
                                        control, controls=8))
    print({k: v for k, v in leak.items() if k != "devs"})
    assert leak["errors"] == [] and leak["steered_errors"] == []
    assert leak["above_tolerance"] == 0, leak["devs"]
    assert leak["steered_min_dev"] > STEERED_MARGIN * TOLERANCE, leak
    assert not math.isnan(leak["steered_min_dev"])


def test_steered_requests_under_load_equal_themselves_alone(served, load_run):
    """No request gets another's steering either: static, named and gated requests equal
    themselves sent alone (a request reading another request's row would not)."""
    server, _, _ = served
    items, outcomes = load_run["items"], load_run["outcomes"]
    sample = lt.leak_sample(items, outcomes, SAMPLE, lt.STEERED_KINDS)
    assert len(sample) == SAMPLE
    assert {items[i].kind for i in sample} == set(lt.STEERED_KINDS)
    leak = asyncio.run(lt.compare_alone(server.url, items, outcomes, sample, 8, TOLERANCE))
    print({k: v for k, v in leak.items() if k != "devs"})
    assert leak["errors"] == []
    assert leak["above_tolerance"] == 0, leak["devs"]


def test_soak_with_aborts_and_preemptions_returns_rows_to_baseline(served, load_run):
    server, commands, shape = served
    items = lt.build_workload(SOAK, shape, seed=4, prompt_len=(16, 64), gen_len=(16, 40),
                              abort_fraction=0.25)
    warmup = lt.build_workload(32, shape, seed=5, prompt_len=(16, 64), gen_len=(16, 40))
    result = lt.soak_on(server.url, server.proc, server.log, commands, shape, items, warmup,
                        CONCURRENCY, rss_every=100)
    # Memory growth over 500 requests is warm-up, not a trend: the benchmark measures it over
    # 10,000 (benchmarks/RESULTS.md); here everything else must hold.
    failures = lt.soak_failures(result, max_rss_growth_mib=math.inf)
    assert failures == []
    assert result["aborted"] >= SOAK // 8
    assert result["preemptions"] > 0
    assert result["idle_after"] == result["idle_before"] == result["idle_fresh"]


def test_a_queued_request_keeps_the_vector_it_was_admitted_with(served, load_run):
    """Steering is fixed at admission: deleting a named vector after the frontend accepted a
    request naming it leaves that request steered with the vector it was admitted with."""
    server, _, shape = served
    client = DynsteerClient(server.url, api_key=lt.KEY)
    vector = lt.unit(np.random.default_rng(23), shape.hidden, lt.VECTOR_NORM)
    client.register_vector("queued-v", vector)
    url = server.url + "/v1/completions"

    def body(spec: dict | None = None, tokens: int = 8, prompt: list[int] | None = None) -> dict:
        return {"model": lt.SERVED, "prompt": prompt or list(range(100, 130)),
                "max_tokens": tokens, "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
                **({"dynsteer": spec} if spec else {})}

    def logprobs(answer: tuple[int, Any]) -> np.ndarray:
        assert answer[0] == 200, answer
        return np.array(answer[1]["choices"][0]["logprobs"]["token_logprobs"])

    plain = logprobs(http("POST", url, body()))
    inline = {"steer": [{"vector": vector.tolist(), "layers": [1, 2]}]}
    steered = logprobs(http("POST", url, body(inline)))
    # 16 long requests ahead of it (the KV cache holds two at a time): it waits in the queue,
    # minutes where other tests' engines share the cores.
    blockers = [threading.Thread(target=http, args=("POST", url, body(
        tokens=220, prompt=[5 + i] * 20)), kwargs={"timeout": 900}) for i in range(16)]
    for thread in blockers:
        thread.start()
    time.sleep(0.5)
    answer: dict[str, Any] = {}
    queued = threading.Thread(target=lambda: answer.update(r=http("POST", url, body(
        {"steer": [{"vector": "queued-v", "layers": [1, 2]}]}), timeout=900)))
    queued.start()
    time.sleep(1.0)
    client.delete_vector("queued-v")
    queued.join()
    for thread in blockers:
        thread.join()
    got = logprobs(answer["r"])
    assert np.abs(steered - plain).max() > 1e-2
    np.testing.assert_allclose(got, steered, atol=1e-4)
