"""`experiments/inspect_refusal.py` end to end, reduced: Inspect AI evaluates a real `dynsteer
serve` of the embedded model (float32, the planted prompts) through the ``dynsteer/`` provider,
unsteered and probe-gated; the eval logs on disk hold each gated sample's gate telemetry, and
the gate fires on the planted harmful requests and on few benign ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_utils import without_inductor
from server_utils import safety_experiment

pytestmark = pytest.mark.engine

PLANTED = Path(__file__).parent / "data" / "planted_prompts.jsonl"


def test_the_eval_logs_hold_each_gated_samples_telemetry(tmp_path_factory):
    import inspect_refusal

    out = tmp_path_factory.mktemp("inspect")
    with safety_experiment(tmp_path_factory) as common:
        summary = inspect_refusal.main(["--prompts", str(PLANTED), "--train-per-label", "16",
                                        "--test-per-label", "6", "--max-tokens", "8",
                                        "--out", str(out), *common])
    assert set(summary) == {"unsteered", "gated"}
    assert summary["unsteered"]["telemetry"] == 0
    assert summary["gated"]["telemetry"] == 12
    assert summary["unsteered"]["harmful"]["fired"] == 0
    assert summary["gated"]["harmful"] == {**summary["gated"]["harmful"], "n": 6, "fired": 6}
    assert summary["gated"]["benign"]["fired"] <= 1
    assert list((out / "logs").iterdir())


def test_the_provider_is_registered_and_says_what_it_needs(monkeypatch):
    from inspect_ai.model import get_model

    monkeypatch.delenv("DYNSTEER_BASE_URL", raising=False)
    with pytest.raises(ValueError, match=r"give the server's URL \(--model-base-url"):
        get_model("dynsteer/default")
    with pytest.raises(ValueError, match=r"model args: \['bogus'\] unknown"):
        get_model("dynsteer/default", base_url="http://127.0.0.1:1", bogus=1)


def test_a_call_whose_connection_drops_is_tried_again():
    """A connection closed before the reply (a server restarting, or closing an idle
    keep-alive connection as it is reused) fails that attempt only: Inspect tries the call
    again, and idle connections are dropped before the server's 5 s keep-alive ends."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx
    from inspect_ai.model import GenerateConfig, get_model

    from dynsteer.inspect_provider import KEEPALIVE_S

    posts: list[int] = []

    class Flaky(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"data": [{"id": "tiny"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            posts.append(1)
            if len(posts) == 1:
                self.close_connection = True  # no reply at all
                return
            self._send({"id": "c1", "model": "tiny", "usage": {},
                        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        model = get_model("dynsteer/tiny", base_url=f"http://127.0.0.1:{server.server_port}",
                          config=GenerateConfig(max_tokens=2))
        output = asyncio.run(model.generate("Hello"))
    finally:
        server.shutdown()
    assert output.completion == "hi" and len(posts) == 2
    assert model.api.should_retry(httpx.ReadError("")) is True
    assert model.api.should_retry(httpx.ReadTimeout("")) is False
    assert KEEPALIVE_S < 5


def test_the_provider_starts_a_server_steers_per_call_and_stops_it(chat_model, monkeypatch):
    """``-M serve=true``: the provider starts `dynsteer serve` itself; a call's spec changes the
    reply and comes back in the output's metadata; closing the model stops the server."""
    import asyncio

    from inspect_ai.model import GenerateConfig, get_model

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = {"steer": [{"vector": [30.0] * 128, "layers": [1]}]}
    greedy = GenerateConfig(max_tokens=6, temperature=0.0)

    async def run() -> tuple[object, object, object]:
        model = get_model(f"dynsteer/{chat_model}", serve=True, config=greedy,
                          serve_args="--dtype float32 --max-model-len 256 --seed 0")
        try:
            plain = await model.generate("Hello there")
            steered = await model.generate(
                "Hello there", config=greedy.merge(GenerateConfig(extra_body={"dynsteer": spec})))
        finally:
            server = model.api._server
            await model.api.aclose()
        return plain, steered, server

    with without_inductor():
        plain, steered, server = asyncio.run(run())
    assert plain.metadata["dynsteer"] == {"spec": None, "telemetry": None, "activations": None}
    assert steered.metadata["dynsteer"]["spec"] == spec
    assert steered.completion != plain.completion
    assert plain.usage.output_tokens == 6
    assert server.proc.poll() is not None
