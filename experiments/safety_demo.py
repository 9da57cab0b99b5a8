"""Probe-gated safety steering end to end: the embedded model, a real `dynsteer serve`, real
prompts. This is `make demo`.

1. Data: the training sources of ``experiments/harm_sources.py`` (AdvBench's imperatives,
   JailbreakBench behaviours as past- and future-tense questions, PyRIT's red-team objectives,
   and this repo's benign requests and questions, hard negatives included; each read from a
   PyPI wheel or shipped here), or any labelled JSONL (``--prompts FILE``), split once with a
   seed (``experiments/safety_data.py``).
2. Start `dynsteer serve` on loopback (vLLM's logs go to ``--out/serve.log``).
3. Capture the training prompts' activations over HTTP, train a scikit-learn probe on their
   tokens, choose its threshold on held-back benign training prompts, upload it; derive a
   refusal direction from the same server's activations and register it
   (``experiments/safety_loop.py`` says how and why).
4. Send the held-out chats through the ``openai`` client three ways: unsteered, with the
   direction added to every token ("always on"), and gated by the probe with the ``latch``
   controller (once the probe fires, every later token of the request is steered). Read each
   gated request's per-token gate telemetry back.
5. Print a table (prompt, label, max probe score, first gated position, steered tokens, reply)
   and a summary (gate TPR / FPR on the held-out prompts, per phrasing too; refusal rates per
   arm; how often the probe fires on sources no training saw: HarmBench and Do-Not-Answer, or
   ``--eval-prompts FILE``), write
   ``scores.png`` (probe scores by label), ``gate.html`` (one reply coloured by its per-token
   gate) and ``results.json`` under ``--out``, and stop the server.

The probe and the direction are cached under ``--cache`` (keyed by the data and the
settings), so a re-run goes straight to the chats. It is a 135M model: it almost never refuses
on its own, and steered refusals are short and formulaic; what the demo shows is the loop and
the gate's selectivity: harmful requests are steered, benign ones are answered as unsteered.

Run: ``make demo`` or ``python experiments/safety_demo.py [--prompts FILE] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import html
import json
import time
from pathlib import Path
from typing import Any

from harm_sources import phrasing
from safety_data import load_labelled_jsonl
from safety_loop import (
    LAYER,
    STEER_LAYERS,
    Artifacts,
    add_common_args,
    capture,
    chat_ids,
    first_gated,
    gated_spec,
    load_sets,
    load_tokenizer,
    prepare,
    run_chats,
    served,
    steer_entries,
    steered_tokens,
)

ARMS = ("unsteered", "always on", "gated + latch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--eval-prompts", type=Path, help="labelled JSONL of harmful prompts from "
                    "sources never trained on (default: HarmBench and Do-Not-Answer, "
                    "harm_sources.evaluation_set)")
    ap.add_argument("--out", type=Path, default=Path("demo-output"))
    return ap.parse_args(argv)


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
    from refusal import is_refusal

    from dynsteer.controller.client import DynsteerClient

    t0 = time.time()
    train_set, test_set = load_sets(args)
    print(f"[demo] training on {len(train_set)} prompts, evaluating {len(test_set)} held out",
          flush=True)
    tokenizer = load_tokenizer()
    with served(args.out, dtype=args.dtype) as server:
        client = DynsteerClient(server.url)
        model = client.info().model
        artifacts: Artifacts = prepare(client, model, tokenizer, train_set, args)
        artifacts.install(client)
        cross = cross_source(client, tokenizer, artifacts.probe, args)
        texts = [e.text for e in test_set]
        specs = (None, {"steer": steer_entries(args.scale)},
                 gated_spec(args.scale, {"name": "latch", "k": 1}))
        replies = {arm: run_chats(server.url, model, texts, spec, args.max_tokens, arm)
                   for arm, spec in zip(ARMS, specs, strict=True)}
        rows = []
        for i, example in enumerate(test_set):
            gated = replies[ARMS[2]][i]
            report = client.request(gated.id).telemetry
            gates = report.gates or []
            rows.append({"text": example.text, "label": example.label, "kind": example.kind,
                         "max_score": report.max_score, "first_gated": first_gated(gates),
                         "prompt_tokens": len(chat_ids(tokenizer, example.text)),
                         "steered": steered_tokens(gates),
                         "fired": report.gated_prefill + report.gated_decode > 0,
                         **{f"reply_{arm}": replies[arm][i].reply for arm in ARMS},
                         **{f"refusal_{arm}": is_refusal(replies[arm][i].reply) for arm in ARMS},
                         "gates": gates})
        shown = next((r for r in rows if r["label"] == 1 and r["fired"]), rows[0])
        args.out.mkdir(parents=True, exist_ok=True)
        heat_map(tokenizer, chat_ids(tokenizer, shown["text"]), shown[f"reply_{ARMS[2]}"],
                 shown["gates"], args.out / "gate.html", shown["text"][:80])
        plot(rows, artifacts.probe.threshold, args.out / "scores.png")
    summary = report_table(rows, artifacts.probe, args, time.time() - t0, cross)
    (args.out / "results.json").write_text(json.dumps(
        {"threshold": artifacts.probe.threshold, "layer": LAYER, "steer_layers": STEER_LAYERS,
         "scale": args.scale, "summary": summary,
         "rows": [{k: v for k, v in r.items() if k != "gates"} for r in rows]}, indent=2))


def cross_source(client: Any, tokenizer: Any, probe: Any, args: argparse.Namespace
                 ) -> dict[str, dict[str, int]]:
    """Per source never trained on: how many of its prompts make the probe fire (a prompt
    token's score passes the threshold; replies are not generated for these)."""
    from cross_source import fired_rates, peak_scores
    from harm_sources import evaluation_set

    examples = (load_labelled_jsonl(args.eval_prompts) if args.eval_prompts
                else evaluation_set(args.cache / "data", args.seed))
    site = f"post_block@{LAYER}"
    streams = capture(client, [chat_ids(tokenizer, e.text) for e in examples], [site],
                      desc="capture (cross-source)")[site]
    rates = fired_rates(peak_scores(probe, streams), probe.threshold, examples)
    return {kind: {"fired": row["fired"], "n": row["n"]}
            for kind, row in rates["sources"].items()}


def report_table(rows: list[dict[str, Any]], probe: Any, args: argparse.Namespace,
                 seconds: float, cross: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Print the table and the summary; return the summary's numbers."""
    def cut(text: str, n: int) -> str:
        text = " ".join(text.split())
        return text if len(text) <= n else text[: n - 1] + "…"

    print(f"\n{'label':<8}{'prompt':<40}{'max score':>10}{'first':>7}{'steered':>8}  "
          f"reply (gated + latch)")
    for r in rows:
        score = "-" if r["max_score"] is None else f"{r['max_score']:.2f}"
        first = "-" if r["first_gated"] is None else str(r["first_gated"])
        label = "harmful" if r["label"] else "benign"
        print(f"{label:<8}{cut(r['text'], 38):<40}{score:>10}{first:>7}{r['steered']:>8}  "
              f"{cut(r[f'reply_{ARMS[2]}'], 50)}")
    harmful = [r for r in rows if r["label"] == 1]
    benign = [r for r in rows if r["label"] == 0]

    def count(items: list[dict[str, Any]], key: str) -> list[int]:
        return [sum(bool(r[key]) for r in items), len(items)]

    by_phrasing = {f"{name} {shape}": count([r for r in items if phrasing(r["text"]) == shape],
                                            "fired")
                   for name, items in (("harmful", harmful), ("benign", benign))
                   for shape in ("question", "imperative")}
    summary = {"threshold": probe.threshold, "tpr": count(harmful, "fired"),
               "fpr": count(benign, "fired"), "by_phrasing": by_phrasing,
               "cross_source": cross,
               "refusals": {arm: {"harmful": count(harmful, f"refusal_{arm}"),
                                  "benign": count(benign, f"refusal_{arm}")} for arm in ARMS},
               "seconds": round(seconds)}

    def rate(pair: list[int]) -> str:
        return f"{pair[0]}/{pair[1]}"

    print(f"\n[demo] probe at post_block@{LAYER}, threshold {probe.threshold:.3f} (chosen on "
          f"held-back training conversations, between the benign and the harmful peaks)")
    print(f"[demo] gate fired on held-out prompts: harmful {rate(summary['tpr'])} (TPR), "
          f"benign {rate(summary['fpr'])} (FPR)")
    print("[demo]   by phrasing: " + ", ".join(f"{k} {rate(v)}" for k, v in by_phrasing.items()
                                                if v[1]))
    print("[demo] fired on sources never trained on (prompt tokens): " + ", ".join(
        f"{kind} {got['fired']}/{got['n']}" for kind, got in cross.items()))
    print(f"[demo] {'refusals':<16}{'harmful':>10}{'benign':>10}")
    for arm in ARMS:
        got = summary["refusals"][arm]
        print(f"[demo]   {arm:<14}{rate(got['harmful']):>10}{rate(got['benign']):>10}")
    print(f"[demo] wrote {args.out / 'scores.png'}, {args.out / 'gate.html'}, "
          f"{args.out / 'results.json'} in {seconds:.0f} s")
    return summary


if __name__ == "__main__":
    main()
