"""Data parallelism: `dynsteer serve --data-parallel-size 2` on the CPU build.

One API server, two engine cores (each with its own scheduler, workers and steering state):
vLLM balances requests over both, and every control-plane change reaches both, because the
frontend's ``collective_rpc`` goes to every engine. Requests of one prompt are sent
concurrently, greedy, so each engine serves some of them; texts are compared between runs of
the same server (batch-invariance is not needed: every run's requests are alike).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server_utils import Server, http

from dynsteer.controller.client import DynsteerClient

pytestmark = pytest.mark.engine

PROMPT = "Hello there, how are"
N = 12
VECTOR = (np.random.default_rng(3).standard_normal(128) * 2).tolist()
STEER = [{"vector": VECTOR, "layers": [1, 2]}]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    srv = Server(chat_model, tmp_path_factory.mktemp("dp") / "serve.log",
                 "--data-parallel-size", "2")  # dynsteer serve asks vLLM for one API server
    srv.model_name = str(chat_model)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def completions(server, spec=None, n: int = N) -> list[str]:
    """``n`` concurrent greedy completions of one prompt (texts)."""
    body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    if spec is not None:
        body["dynsteer"] = spec

    def one(_: int) -> str:
        status, out = http("POST", server.url + "/v1/completions", body)
        assert status == 200, out
        return out["choices"][0]["text"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def served_per_engine(server) -> dict[str, float]:
    """Finished requests per engine, from vLLM's metrics (label ``engine``)."""
    _, text = http("GET", server.url + "/metrics")
    counts: dict[str, float] = {}
    for engine, value in re.findall(
            r'^vllm:request_success_total\{engine="(\d+)",[^}]*\} (\S+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def test_global_steering_reaches_both_engines_and_clears_on_both(server):
    """Global steering changes every request, whichever engine serves it; clearing it gives
    the baseline back everywhere; both engines served requests in each run."""
    client = DynsteerClient(server.url)
    before = served_per_engine(server)
    baseline = completions(server)
    assert len(set(baseline)) == 1
    client.set_global(STEER)
    try:
        steered = completions(server)
    finally:
        client.clear_global()
    assert not set(steered) & set(baseline), "a request ran without the global steering"
    assert completions(server) == baseline
    after = served_per_engine(server)
    assert set(after) == {"0", "1"}
    assert all(after[e] - before.get(e, 0.0) > 0 for e in after), (before, after)


def test_per_request_steering_is_served_by_both_engines(server):
    """A request's own spec steers it on either engine exactly as global steering does."""
    client = DynsteerClient(server.url)
    client.set_global(STEER)
    try:
        under_global = completions(server, n=4)
    finally:
        client.clear_global()
    assert completions(server, spec={"steer": STEER}) == [under_global[0]] * N


def test_more_than_one_api_server_is_refused(chat_model, tmp_path):
    """Each API server process would keep its own registry and prefix-cache fingerprints:
    ``--api-server-count 2`` stops before any engine starts, with a message naming the flag
    (``vllm serve`` with the plugin refuses it when the API server starts)."""
    srv = Server(chat_model, tmp_path / "serve.log", "--api-server-count", "2")
    try:
        with pytest.raises((RuntimeError, TimeoutError)):
            srv.wait_ready(timeout=300)
        assert "--api-server-count > 1 is not supported" in srv.log_tail(400)
    finally:
        srv.stop()
