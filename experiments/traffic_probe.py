"""A probe trained on live traffic: capture into a sink while serving, read back, train, upload.

On the embedded model (SmolLM2-135M-Instruct, CPU is enough), over HTTP only:

1. Start `dynsteer serve` with a filesystem capture sink (``--dynsteer-capture-sinks``) and
   register a "pirate" steering vector (the mean difference of captured pirate and plain
   phrasings, as in ``serve_demo.py``).
2. Turn on the global capture (``PUT /v1/dynsteer/capture/global``): every non-streaming
   completion's generated tokens at the probe's site go to the sink, float16.
3. Serve traffic: benign questions (``data/benign_questions.jsonl``), every other one steered
   by the pirate vector, sent concurrently by an ``openai`` client that knows nothing of the
   capture. Then turn the capture off.
4. Read the sink back (``dynsteer.capture.open``), label each request's tokens by whether the
   request was steered, train a logistic regression on their tokens, calibrate its threshold
   so that at most 5% of those plain requests have a token above it, and upload it
   (``dynsteer.probes.upload``).
5. New traffic, held out: the probe gates a zero-scale entry on every request, so its gate
   telemetry says on which requests it fired; print the rate on steered and on plain ones.

Run: ``python experiments/traffic_probe.py [--requests N] [--max-tokens T]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pirate import LAYER, PIRATE, PLAIN

READ = LAYER + 4
"""The probe's site: ``post_block`` four layers after the one the vector is added at."""
STEER_SCALE = 4.0
DATA = Path(__file__).parent / "data" / "benign_questions.jsonl"


def questions(n: int) -> list[str]:
    rows = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    return rows[:n]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96,
                        help="traffic requests to train on (half steered); as many held out")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    import numpy as np
    import openai
    from sklearn.linear_model import LogisticRegression

    from dynsteer import capture
    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.launch import ServerProcess
    from dynsteer.probes import calibrate_threshold, from_sklearn, upload

    site = f"post_block@{READ}"
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            ["--max-model-len", "1024", "--max-num-seqs", "16",
             "--dynsteer-capture-sinks", f"traffic={tmp}/traffic?seal_after_s=1",
             "--additional-config",
             json.dumps({"dynsteer": {"monitor_sites": f"post_block@{LAYER},{site}"}})],
            Path(tmp) / "serve.log") as server:
        print(f"starting dynsteer serve on {server.url} (log: {server.log}) ...", flush=True)
        server.wait_ready()
        client = DynsteerClient(server.url)
        acts = client.capture(PIRATE + PLAIN, [f"post_block@{LAYER}"], reduce="mean")
        vector = acts[f"post_block@{LAYER}"]
        client.register_vector("pirate", vector[:4].mean(0) - vector[4:].mean(0))
        steer = [{"vector": "pirate", "layers": [LAYER], "scale": STEER_SCALE}]

        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = oai.models.list().data[0].id
        texts = questions(2 * args.requests)
        train, held_out = texts[:args.requests], texts[args.requests:]

        def serve(batch: list[str], extra_of) -> list[tuple[str, bool]]:
            def one(i: int) -> tuple[str, bool]:
                steered = i % 2 == 1
                r = oai.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": batch[i]}],
                    max_tokens=args.max_tokens, temperature=0.0,
                    extra_body=extra_of(steered))
                return r.id, steered

            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, range(len(batch))))

        # Live traffic, captured by the server into the sink (the clients ask for nothing).
        client.set_global_capture({"sites": site, "positions": "generated",
                                   "dtype": "float16", "sink": "traffic"})
        t0 = time.time()
        served = serve(train, lambda steered: {"dynsteer": {"steer": steer}} if steered
                       else None)
        client.clear_global_capture()
        print(f"served {len(served)} requests in {time.time() - t0:.0f} s, captured into the "
              "sink")

        store = capture.open(f"{tmp}/traffic")
        while len(store) < len(served):
            time.sleep(0.5)
            store = capture.open(f"{tmp}/traffic")
        steered_ids = {rid for rid, steered in served if steered}
        rows, labels = [], []
        for request in store:
            rows.append(request[site].astype(np.float32))
            labels.append(request.request_id in steered_ids)
        x = np.concatenate(rows)
        y = np.concatenate([[label] * len(r) for r, label in zip(rows, labels, strict=True)])
        print(f"read back {len(store)} requests, {len(x)} tokens, {int(y.sum())} steered")

        fitted = LogisticRegression(C=1.0, max_iter=4000).fit(x, y)
        probe = from_sklearn(fitted, layer=READ, name="pirate-traffic")
        # A request is flagged when any of its tokens fires: calibrate on each plain
        # request's highest-scoring token, so at most 5% of plain requests fire.
        plain_tops = np.stack([r[np.argmax(probe.score(r))]
                               for r, label in zip(rows, labels, strict=True) if not label])
        probe = calibrate_threshold(probe, plain_tops, target_fpr=0.05)
        upload(probe, server.url)

        gate = {"gate": {"probe": "pirate-traffic", "layer": READ,
                         "steer": [{"vector": "pirate", "layers": [READ], "scale": 0.0}]}}
        checked = serve(held_out, lambda steered: {"dynsteer": {
            **gate, **({"steer": steer} if steered else {})}})
        fired = {True: 0, False: 0}
        for request_id, steered in checked:
            telemetry = client.request(request_id).telemetry
            fired[steered] += telemetry.gated_decode > 0
        half = len(checked) // 2
        rates = {"steered": fired[True] / half, "plain": fired[False] / (len(checked) - half)}
        print(f"held out: the probe fired on {fired[True]}/{half} steered requests and "
              f"{fired[False]}/{len(checked) - half} plain ones")
        return rates


if __name__ == "__main__":
    main()
