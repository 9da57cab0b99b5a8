"""Serving demo: `dynsteer serve` on the embedded model, driven over HTTP only (CPU is enough).

1. Start `dynsteer serve` (no MODEL: the embedded SmolLM2-135M-Instruct).
2. Capture the residual stream after layer L for "pirate" and plain phrasings through the
   server (POST /v1/dynsteer/capture) and register their mean difference as a named vector.
3. Chat through the `openai` client: unsteered, steered per request (extra_body), and under
   global steering (PUT/DELETE /v1/dynsteer/global).
4. Train a probe on the captured activations (scikit-learn), upload it, and let it gate the
   steering token by token; read the gate telemetry back (GET /v1/dynsteer/requests/{id}).
5. Show the dynsteer lines of /metrics.

Run: ``make serve-demo`` (or ``python experiments/serve_demo.py``).
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

from pirate import LAYER, PIRATE, PLAIN, SCALE

QUESTION = [{"role": "user", "content": "Tell me about your day."}]


def main() -> None:
    import numpy as np
    import openai
    from sklearn.linear_model import LogisticRegression

    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.launch import ServerProcess
    from dynsteer.probes import from_sklearn, upload

    site = f"post_block@{LAYER}"
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            ["--max-model-len", "1024", "--dynsteer-probe-store", f"{tmp}/probes",
             # the probe reads (and capture records) the pirate layer
             "--additional-config", json.dumps({"dynsteer": {"monitor_sites": site}})],
            Path(tmp) / "serve.log") as server:
        print(f"starting dynsteer serve on {server.url} (log: {server.log}) ...", flush=True)
        server.wait_ready()
        client = DynsteerClient(server.url)
        info = client.info()
        print(f"serving {info.model}: hidden {info.hidden_size}, {info.num_layers} layers, "
              f"vLLM {info.vllm_version}")

        acts = client.capture(PIRATE + PLAIN, [site], reduce="mean")[site]
        client.register_vector("pirate", acts[:4].mean(0) - acts[4:].mean(0))

        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = oai.models.list().data[0].id

        def chat(**extra: object) -> tuple[str, str]:
            r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=40,
                                            temperature=0.0, extra_body=extra or None)
            return r.id, r.choices[0].message.content or ""

        steer = [{"vector": "pirate", "layers": [LAYER], "scale": SCALE}]
        print("\n[unsteered]   ", chat()[1])
        print("[per request] ", chat(dynsteer={"steer": steer})[1])
        client.set_global(steer)
        print("[global]      ", chat()[1])
        client.clear_global()
        print("[cleared]     ", chat()[1])

        labels = np.array([1] * 4 + [0] * 4)
        probe = from_sklearn(LogisticRegression(C=10.0, max_iter=2000).fit(acts, labels),
                             layer=LAYER, name="pirate-talk")
        upload(probe, server.url)
        gated = {"gate": {"probe": "pirate-talk", "layer": LAYER,
                          "steer": [{"vector": "pirate", "layers": [LAYER + 1],
                                     "scale": -SCALE}]}}
        request_id, text = chat(dynsteer=gated)
        report = client.request(request_id).telemetry
        print(f"\n[gated by probe] {text}\n  tokens monitored {report.tokens_monitored}, "
              f"gated in prompt {report.gated_prefill}, in output {report.gated_decode}")

        with urllib.request.urlopen(server.url + "/metrics") as r:
            lines = [ln for ln in r.read().decode().splitlines()
                     if ln.startswith("dynsteer_") and not ln.startswith("dynsteer_rows")]
        print("\n/metrics:\n  " + "\n  ".join(lines))


if __name__ == "__main__":
    main()
