"""`dynsteer serve` on the GPU (vLLM's OpenAI server with the endpoint plugin), against an offline
CUDA engine of the same model: the CPU tests of ``test_server.py`` below. The routes are in the
OpenAPI document; per-request steering through the openai client both ways equals offline
``LLM.chat``; completions take the spec; global steering sets and clears; gate telemetry equals
offline; ``/metrics`` counters move; bad specs are HTTP 400 naming the field.

The tiny chat model takes its tokenizer from ``$DYNSTEER_TOKENIZER`` (``conftest.chat_model``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_server import (  # collected here, with this module's fixtures
    KEY,
    test_bad_specs_are_400_naming_the_field,
    test_completions_route_takes_the_spec,
    test_gated_request_telemetry_matches_offline,
    test_global_steering_changes_outputs_and_returns_to_baseline,
    test_metrics_move,
    test_openapi_lists_the_routes,
    test_steered_chat_both_ways_equals_offline,
)

pytestmark = pytest.mark.engine

__all__ = [
    "test_bad_specs_are_400_naming_the_field",
    "test_completions_route_takes_the_spec",
    "test_gated_request_telemetry_matches_offline",
    "test_global_steering_changes_outputs_and_returns_to_baseline",
    "test_metrics_move",
    "test_openapi_lists_the_routes",
    "test_steered_chat_both_ways_equals_offline",
]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory) -> Any:
    """The server (its GPU share: ``DYNSTEER_TEST_GPU_MEMORY``, set by the conftest)."""
    from server_utils import Server

    srv = Server(chat_model, tmp_path_factory.mktemp("server") / "serve.log",
                 "--dynsteer-api-key", KEY, "--dynsteer-max-body-bytes", "65536")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(chat_model, server) -> Any:
    """The reference: the same model in an offline ``LLM`` (started while the server boots)."""
    from engine_utils import start_llm, stop_llm

    llm = start_llm(chat_model, dynsteer={}, skip_tokenizer_init=False, max_num_seqs=8,
                    gpu_memory_utilization=0.25)
    try:
        server.wait_ready()
        yield llm
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def openai_client(server, offline) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def client(server, offline) -> Any:
    from dynsteer.controller.client import DynsteerClient

    return DynsteerClient(server.url, api_key=KEY)
