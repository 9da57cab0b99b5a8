"""Probe-gated safety steering end to end, on the embedded model and a real `dynsteer serve`.

What it does (CPU is enough; everything over HTTP on loopback, as a deployment would):

1. Data: AdvBench's harmful behaviours (from the ``pyrit`` 1.1.0 wheel, MIT) and this repo's
   benign requests (hard negatives included), or any labelled JSONL (``--prompts FILE``),
   split once with a seed (``experiments/safety_data.py``).
2. Start `dynsteer serve` (vLLM's logs go to a file) with the probe's layer as monitor site.
3. Capture the residual stream of the training prompts (chat-formatted, as the model sees them)
   at that site through ``POST /v1/dynsteer/capture``.
4. Train a scikit-learn probe on *tokens*, as the gate reads them: every token of a benign
   prompt and the chat template's shared prefix of every prompt are negatives, the tokens of a
   harmful request from its first own token on are positives (fit on 70% of the training
   prompts); put the threshold where at most ``--fpr`` of the other 30%'s benign prompts would
   fire on any token, and upload it. The steering direction is the difference of the two
   classes' mean last-token activations.
5. Send the held-out chats through the ``openai`` client, unsteered and with the gate plus the
   ``latch`` controller (once the probe fires, every later token is steered), and read each
   request's gate telemetry back.
6. Print a table and a summary (gate TPR / FPR, refusal rates with and without steering),
   write ``scores.png`` (probe scores by label) and ``gate.html`` (one reply coloured by its
   per-token gate) under ``--out``, stop the server.

Activations, the probe and the direction are cached under ``--cache`` (keyed by the data and
the settings), so a re-run skips straight to the chats. It is a 135M model: it rarely refuses
on its own, and the steering direction is a mean difference, not a tuned refusal vector; the
point is the loop, the gate's selectivity and the plumbing, not the refusal rate.

Run: ``make demo`` or ``python experiments/safety_demo.py [--prompts FILE] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LAYER = 15
"""SmolLM2-135M (30 layers): the middle, where request intent is linearly readable."""
STEER_LAYERS = [15, 16, 17]
SESSION_MAX_TOKENS = 48


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, help="labelled JSONL ({text, label}) instead of "
                    "AdvBench + the repo's benign set")
    ap.add_argument("--train-per-label", type=int, default=64)
    ap.add_argument("--test-per-label", type=int, default=24)
    ap.add_argument("--fpr", type=float, default=0.05,
                    help="fraction of benign calibration prompts allowed to fire the gate")
    ap.add_argument("--scale", type=float, default=0.3, help="multiplier of the direction")
    ap.add_argument("--max-tokens", type=int, default=SESSION_MAX_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("demo-output"))
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dynsteer" / "demo")
    return ap.parse_args(argv)


def progress(items: Any, desc: str, total: int | None = None) -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids the server's chat route feeds the model for one user turn."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


def capture(client: Any, ids: list[list[int]], site: str, reduce: str,
            batch: int = 16) -> list[Any]:
    out: list[Any] = []
    for start in progress(range(0, len(ids), batch), f"capture ({reduce})",
                          total=-(-len(ids) // batch)):
        got = client.capture(ids[start:start + batch], [site], reduce=reduce)[site]
        out.extend(list(got))
    return out


def train(client: Any, tokenizer: Any, train_set: list[Any], args: argparse.Namespace,
          site: str) -> tuple[Any, Any]:
    """(probe, direction) from the training prompts' activations (cached)."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from dynsteer.probes import Probe, calibrate_threshold, from_sklearn

    key = hashlib.sha256(json.dumps([[e.text, e.label] for e in train_set] + [
        site, args.fpr], sort_keys=True).encode()).hexdigest()[:16]
    folder = args.cache / key
    if (folder / "probe.safetensors").exists():
        return Probe.load(folder / "probe.safetensors"), np.load(folder / "direction.npy")
    ids = [chat_ids(tokenizer, e.text) for e in train_set]
    labels = np.array([e.label for e in train_set])
    streams = capture(client, ids, site, "all")
    prefix = shared_prefix(ids)
    fit = np.random.default_rng(args.seed).random(len(streams)) < 0.7
    token_labels = [np.r_[np.zeros(prefix), np.full(len(s) - prefix, y)]
                    for s, y in zip(streams, labels, strict=True)]
    classifier = LogisticRegression(C=0.05, max_iter=5000, class_weight="balanced").fit(
        np.concatenate([s for s, f in zip(streams, fit, strict=True) if f]),
        np.concatenate([t for t, f in zip(token_labels, fit, strict=True) if f]))
    probe = from_sklearn(classifier, layer=LAYER, name="harmful-request",
                         metadata={"data": "advbench+benign" if not args.prompts else
                                   str(args.prompts)})
    # A benign prompt fires if any of its tokens does: calibrate on each held-back benign
    # prompt's highest-scoring token.
    peaks = np.stack([s[np.argmax(probe.score(s))] for s, y, f in zip(
        streams, labels, fit, strict=True) if y == 0 and not f])
    probe = calibrate_threshold(probe, peaks, args.fpr)
    last = np.stack([s[-1] for s in streams])
    direction = (last[labels == 1].mean(0) - last[labels == 0].mean(0)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    probe.save(folder / "probe.safetensors")
    np.save(folder / "direction.npy", direction)
    return probe, direction


def run_chats(base_url: str, model: str, texts: list[str], spec: dict | None,
              max_tokens: int, desc: str) -> list[tuple[str, str]]:
    """(response id, reply) per prompt, 8 in flight (the engine batches them)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=2)

    def one(text: str) -> tuple[str, str]:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=0.0, extra_body={"dynsteer": spec} if spec else None)
        return response.id, response.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        return list(progress(pool.map(one, texts), desc, total=len(texts)))


def shared_prefix(ids: list[list[int]]) -> int:
    """Tokens every prompt starts with (the chat template before the user's words)."""
    n = min(len(i) for i in ids)
    return next((p for p in range(n) if len({i[p] for i in ids}) > 1), n)


def first_gated(gates: list[float | None]) -> int | None:
    return next((i for i, g in enumerate(gates) if g is not None and g > 0.5), None)


def heat_map(tokenizer: Any, ids: list[int], reply: str, gates: list[float | None],
             path: Path, title: str) -> None:
    """One request's tokens coloured by their gate (prompt, then reply)."""
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    tokens = [tokenizer.decode([t]) for t in [*ids, *reply_ids]]
    spans = []
    for i, token in enumerate(tokens):
        gate = gates[i] if i < len(gates) and gates[i] is not None else 0.0
        spans.append(f'<span title="position {i}, gate {gate:.3f}" style="background:'
                     f'rgba(220,40,40,{gate:.3f})">{html.escape(token)}</span>')
        if i == len(ids) - 1:
            spans.append("<hr>")
    path.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
                    f"<h3>{html.escape(title)}</h3><p>red = gate (probe-gated steering "
                    f"applied to that token)</p><pre style='white-space:pre-wrap'>"
                    f"{''.join(spans)}</pre>")


def plot(rows: list[dict[str, Any]], threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, name, color in ((1, "harmful", "tab:red"), (0, "benign", "tab:blue")):
        scores = [r["max_score"] for r in rows if r["label"] == label and r["max_score"]
                  is not None]
        ax.hist(scores, bins=20, alpha=0.6, color=color, label=f"{name} (held out)")
    ax.axvline(threshold, color="black", linestyle="--", label="threshold")
    ax.set_xlabel("max probe score over the request's tokens")
    ax.set_ylabel("requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers
    from refusal import is_refusal
    from safety_data import balanced, default_examples, load_labelled_jsonl, split

    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.launch import ServerProcess
    from dynsteer.engine_ext.default_model import default_model_path
    from dynsteer.probes import upload

    t0 = time.time()
    examples = (load_labelled_jsonl(args.prompts) if args.prompts
                else default_examples(args.cache / "data"))
    train_set, test_set = split(examples, seed=args.seed)
    train_set = balanced(train_set, args.train_per_label, seed=args.seed)
    test_set = balanced(test_set, args.test_per_label, seed=args.seed)
    print(f"[demo] {len(examples)} prompts; training on {len(train_set)}, "
          f"evaluating {len(test_set)} held out", flush=True)
    model_path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    site = f"post_block@{LAYER}"
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"dynsteer": {"monitor_sites": site}}
    with ServerProcess(["--max-model-len", "1024", "--additional-config", json.dumps(config)],
                       args.out / "serve.log") as server:
        print(f"[demo] starting dynsteer serve (log: {server.log}) ...", flush=True)
        server.wait_ready()
        print(f"[demo] server ready after {time.time() - t0:.0f} s", flush=True)
        client = DynsteerClient(server.url)
        probe, direction = train(client, tokenizer, train_set, args, site)
        upload(probe, server.url)
        client.register_vector("away", direction)
        gate = {"probe": probe.name, "layer": LAYER, "trace": True,
                "steer": [{"vector": "away", "layers": STEER_LAYERS, "scale": args.scale}]}
        gated = {"gate": gate, "controller": {"name": "latch", "k": 1}}
        model = client.info().model
        texts = [e.text for e in test_set]
        plain = run_chats(server.url, model, texts, None, args.max_tokens, "unsteered")
        steered = run_chats(server.url, model, texts, gated, args.max_tokens, "gated")
        rows = []
        for example, (_, base), (rid, reply) in zip(test_set, plain, steered, strict=True):
            report = client.request(rid).telemetry
            gates = report.gates or []
            rows.append({"text": example.text, "label": example.label, "kind": example.kind,
                         "max_score": report.max_score, "first_gated": first_gated(gates),
                         "steered": sum(1 for g in gates if g is not None and g > 0.5),
                         "fired": report.gated_prefill + report.gated_decode > 0,
                         "refusal_plain": is_refusal(base), "refusal_gated": is_refusal(reply),
                         "reply": reply, "plain": base, "gates": gates})
        shown = next((r for r in rows if r["label"] == 1 and r["fired"]), rows[0])
        heat_map(tokenizer, chat_ids(tokenizer, shown["text"]), shown["reply"], shown["gates"],
                 args.out / "gate.html", shown["text"][:80])
        plot(rows, probe.threshold, args.out / "scores.png")
    report_table(rows, probe, args, time.time() - t0)
    (args.out / "results.json").write_text(json.dumps(
        {"threshold": probe.threshold, "rows": [{k: v for k, v in r.items() if k != "gates"}
                                                for r in rows]}, indent=2))


def report_table(rows: list[dict[str, Any]], probe: Any, args: argparse.Namespace,
                 seconds: float) -> None:
    def cut(text: str, n: int) -> str:
        text = " ".join(text.split())
        return text if len(text) <= n else text[: n - 1] + "…"

    print(f"\n{'label':<8}{'prompt':<42}{'max score':>10}{'first':>7}{'steered':>8}  reply")
    for r in rows:
        score = "-" if r["max_score"] is None else f"{r['max_score']:.2f}"
        first = "-" if r["first_gated"] is None else str(r["first_gated"])
        label = "harmful" if r["label"] else "benign"
        print(f"{label:<8}{cut(r['text'], 40):<42}{score:>10}{first:>7}{r['steered']:>8}  "
              f"{cut(r['reply'], 48)}")
    harmful = [r for r in rows if r["label"] == 1]
    benign = [r for r in rows if r["label"] == 0]

    def rate(items: list[dict[str, Any]], key: str) -> str:
        return f"{sum(r[key] for r in items)}/{len(items)}" if items else "-"

    print(f"\n[demo] probe threshold {probe.threshold:.3f} (at most {args.fpr:.0%} of benign "
          f"calibration prompts fire)")
    print(f"[demo] gate fired: harmful {rate(harmful, 'fired')} (TPR), benign "
          f"{rate(benign, 'fired')} (FPR)")
    print(f"[demo] refusals without steering: harmful {rate(harmful, 'refusal_plain')}, benign "
          f"{rate(benign, 'refusal_plain')}; with gated steering: harmful "
          f"{rate(harmful, 'refusal_gated')}, benign {rate(benign, 'refusal_gated')}")
    print(f"[demo] wrote {args.out / 'scores.png'}, {args.out / 'gate.html'}, "
          f"{args.out / 'results.json'} in {seconds:.0f} s")


if __name__ == "__main__":
    main()
