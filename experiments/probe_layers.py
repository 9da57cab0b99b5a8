"""Probe accuracy by layer and hook: where a linear probe reads "harmful request" best.

Why: a gate reads one monitor site, and its probe is only as good as the site it reads
(the safety demo's reads ``post_block@15``, ``safety_loop.LAYER``). This measures that choice:
held-out AUROC of a linear probe at every (hook, layer) site of the embedded model.

What it does (CPU is enough; activations come from a real `dynsteer serve`, as for the demo):

1. Data: the training sources of ``harm_sources.py`` (harmful imperatives and questions, benign
   requests of the same shapes), or any labelled JSONL
   (``--prompts FILE``), split once with ``--seed`` and subsampled per label
   (``safety_loop.load_sets``); prompts are chat-formatted as the model sees them.
2. Start `dynsteer serve` (vLLM's logs go to ``--out``/serve.log) with every requested site as a
   monitor site (``--hooks`` x ``--layers``) and ``capture_lanes`` raised so that one capture
   pass records 32 sites, then capture every prompt token at those sites
   (``POST /v1/dynsteer/capture``, ``reduce="all"``), 32 sites at a time.
3. Per site, two scikit-learn probes (standardized features, L2 logistic regression, classes
   weighted to balance), each scored on the held-out prompts with ``roc_auc_score``:

   * ``last``: trained and scored on the last prompt token (the end of the chat template, where
     the reply starts), one vector per prompt;
   * ``max``: the per-token view the gate takes: a probe trained on tokens, and a held-out
     prompt scored by its highest-scoring token (the gate fires if any token does). With
     ``--positives suffix`` (the default; the positives ``safety_loop.train_probe`` gives the
     gate, which also adds the model's replies as negatives: this sweep reads prompts only) the
     positives are the chat template's closing tokens of harmful prompts and every other token
     is a negative; with ``--positives request`` every token of a harmful prompt after the
     template's opening is a positive, and the negatives are every token of a benign prompt and
     the template's opening of every prompt.
4. Print a table (layer x hook, both readouts) and the best site of each readout, write
   ``probe_layers.json`` and ``probe_layers.png`` (AUROC against layer, one line per hook) under
   ``--out``, stop the server.

In the engine's Llama-style forward, ``pre_attn@L+1`` is the same stream as ``post_block@L``
(the residual add between them is fused into the next RMSNorm), so those curves are one
curve shifted by a layer; ``pre_attn@0`` is the token embedding.

Run: ``python experiments/probe_layers.py [--layers 0-29] [--hooks post_block] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

HOOKS = "pre_attn,post_attn,post_block"
LANES = 32
"""Sites one capture request records (the engine's ``capture_lanes``): its buffer costs
``LANES x 1025 x hidden x 4`` bytes (76 MB at SmolLM2's hidden 576), and fewer passes mean
fewer prefills of the same prompts."""
C = 0.05
"""Inverse L2 strength of both probes, on standardized features: modest, so that a probe of
576 features on ~100 prompts does not fit noise."""
TOL = 1e-3
"""lbfgs stopping tolerance: half the iterations of sklearn's 1e-4 for held-out AUROCs within
0.005 of it (measured on the default data at layers 0, 3 and 15)."""
READOUTS = ("last", "max")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, help="labelled JSONL ({text, label}) instead of "
                    "AdvBench + the repo's benign set")
    ap.add_argument("--train-per-label", type=int, default=128)
    ap.add_argument("--test-per-label", type=int, default=96)
    ap.add_argument("--layers", default="*", help="layers in the site grammar: '*' (every "
                    "layer, the default), '0-29', '5+10+15', '50%%'")
    ap.add_argument("--hooks", default=HOOKS, help=f"comma-separated hooks (default {HOOKS})")
    ap.add_argument("--positives", choices=("suffix", "request"), default="suffix",
                    help="token probe positives: the chat template's closing tokens of harmful "
                    "prompts (suffix, the gate's positives in safety_loop.train_probe) or every "
                    "token of a harmful prompt after the template's opening (request)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per capture request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("probe-layers-output"))
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dynsteer" / "demo",
                    help="where the AdvBench wheel is cached (under data/), as for the demo")
    return ap.parse_args(argv)


def monitor_sites(hooks: str, layers: str) -> str:
    """The engine option naming every requested site (ValueError if not in the site grammar)."""
    from dynsteer.controller.contract import check_site_grammar

    sites = ",".join(f"{hook.strip()}@{layers}" for hook in hooks.split(",") if hook.strip())
    check_site_grammar(sites)
    return sites


def fit_and_score(x_train: np.ndarray, y_train: np.ndarray, x_test: list[np.ndarray],
                  count: np.ndarray | None = None) -> np.ndarray:
    """Train a standardized logistic probe (classes weighted to balance) and return each test
    item's highest decision value; a test item is one prompt's ``[tokens, hidden]``, or
    ``[1, hidden]`` for the last token. ``count[i]``: how many training rows row ``i`` stands
    for (the chat template's prefix is one row standing for every prompt's copy)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    count = np.ones(len(y_train)) if count is None else count
    per_class = np.array([count[y_train == c].sum() for c in (0, 1)])
    weight = count * (count.sum() / (2 * per_class))[y_train]
    probe = make_pipeline(StandardScaler(), LogisticRegression(C=C, tol=TOL, max_iter=2000)).fit(
        x_train, y_train, standardscaler__sample_weight=count,
        logisticregression__sample_weight=weight)
    scores = probe.decision_function(np.concatenate(x_test))
    ends = np.cumsum([len(x) for x in x_test])
    return np.array([part.max() for part in np.split(scores, ends[:-1])])


def token_labels(lengths: list[int], labels: np.ndarray, prefix: int, suffix: int,
                 positives: str) -> list[np.ndarray]:
    """Per training prompt, the label of each token after the shared ``prefix`` (see the
    module docstring for ``positives``)."""
    if positives == "request":
        return [np.full(n - prefix, y) for n, y in zip(lengths, labels, strict=True)]
    return [np.r_[np.zeros(n - prefix - suffix, dtype=labels.dtype), np.full(suffix, y)]
            for n, y in zip(lengths, labels, strict=True)]


def site_auroc(train: list[np.ndarray], y_train: np.ndarray, test: list[np.ndarray],
               y_test: np.ndarray, prefix: int, suffix: int, positives: str) -> dict[str, float]:
    """Held-out AUROC of the ``last`` and ``max`` readouts at one site (see the docstring).

    Every prompt's first ``prefix`` tokens are the same, so their stream is too (the model is
    causal): the token probe trains on one copy, weighted by the number of prompts, which is
    the same loss as all copies at half the rows."""
    from sklearn.metrics import roc_auc_score

    last = fit_and_score(np.stack([s[-1] for s in train]), y_train, [s[-1:] for s in test])
    tokens = np.concatenate([train[0][:prefix], *(s[prefix:] for s in train)])
    labels = np.concatenate([np.zeros(prefix, dtype=y_train.dtype), *token_labels(
        [len(s) for s in train], y_train, prefix, suffix, positives)])
    count = np.r_[np.full(prefix, len(train)), np.ones(len(tokens) - prefix)]
    peak = fit_and_score(tokens, labels, test, count)
    return {"last": float(roc_auc_score(y_test, last)), "max": float(roc_auc_score(y_test, peak))}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, readout, name in zip(axes, READOUTS, ("last prompt token", "max over tokens (gate)"),
                                 strict=True):
        for hook in hooks:
            mine = [r for r in rows if r["hook"] == hook]
            ax.plot([r["layer"] for r in mine], [r[f"auroc_{readout}"] for r in mine],
                    marker="o", markersize=3, label=hook)
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out AUROC")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_table(rows: list[dict[str, Any]]) -> str:
    """Layer rows, one ``last / max`` column per hook."""
    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    by_site = {(r["hook"], r["layer"]): r for r in rows}
    lines = [f"{'layer':>5}" + "".join(f"{hook + ' last/max':>24}" for hook in hooks)]
    for layer in sorted({r["layer"] for r in rows}):
        cells = []
        for hook in hooks:
            row = by_site.get((hook, layer))
            cells.append("-" if row is None
                         else f"{row['auroc_last']:.3f} / {row['auroc_max']:.3f}")
        lines.append(f"{layer:>5}" + "".join(f"{cell:>24}" for cell in cells))
    return "\n".join(lines)


def best_sites(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per readout, the site of highest AUROC (the earliest in forward order on a tie) and how
    many sites reach that AUROC (a saturated readout ties at many)."""
    best = {}
    for readout in READOUTS:
        top = max(rows, key=lambda r: r[f"auroc_{readout}"])
        best[readout] = {"site": top["site"], "auroc": top[f"auroc_{readout}"],
                         "tied": sum(r[f"auroc_{readout}"] == top[f"auroc_{readout}"]
                                     for r in rows)}
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; returns what ``probe_layers.json`` holds."""
    args = parse_args(argv)
    from safety_loop import (
        capture,
        chat_ids,
        load_sets,
        load_tokenizer,
        progress,
        shared_prefix,
        shared_suffix,
    )

    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.contract import resolve_sites, site_name
    from dynsteer.controller.launch import ServerProcess

    t0 = time.time()
    monitor = monitor_sites(args.hooks, args.layers)
    train_set, test_set = load_sets(args)
    print(f"[probe_layers] training on {len(train_set)} prompts, evaluating {len(test_set)} "
          f"held out; token probe positives: {args.positives}", flush=True)
    tokenizer = load_tokenizer()
    ids = [chat_ids(tokenizer, e.text) for e in [*train_set, *test_set]]
    prefix, suffix = shared_prefix(ids), shared_suffix(ids)
    y_train = np.array([e.label for e in train_set])
    y_test = np.array([e.label for e in test_set])
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"dynsteer": {"sites": monitor, "monitor_sites": monitor, "capture_lanes": LANES}}
    rows: list[dict[str, Any]] = []
    with ServerProcess(["--max-model-len", "1024", "--additional-config", json.dumps(config)],
                       args.out / "serve.log") as server:
        print(f"[probe_layers] starting dynsteer serve (log: {server.log}) ...", flush=True)
        server.wait_ready()
        t_ready = time.time()
        print(f"[probe_layers] server ready after {t_ready - t0:.0f} s", flush=True)
        client = DynsteerClient(server.url, timeout=600)
        info = client.info()
        sites = [site_name(s) for s in resolve_sites(monitor, info.num_layers)]
        for start in range(0, len(sites), LANES):
            chunk = sites[start:start + LANES]
            streams = capture(client, ids, chunk, args.batch, f"capture {chunk[0]}..{chunk[-1]}")
            for site in progress(chunk, "probes"):
                hook, layer = site.split("@")
                auroc = site_auroc(streams[site][:len(train_set)], y_train,
                                   streams[site][len(train_set):], y_test, prefix, suffix,
                                   args.positives)
                rows.append({"site": site, "hook": hook, "layer": int(layer),
                             "auroc_last": auroc["last"], "auroc_max": auroc["max"]})
    seconds = time.time() - t0
    best = best_sites(rows)
    results = {"model": info.model, "num_layers": info.num_layers, "hidden": info.hidden_size,
               "data": str(args.prompts) if args.prompts else "harm_sources.training_pool",
               "train": len(train_set), "test": len(test_set), "seed": args.seed,
               "positives": args.positives, "shared_prefix_tokens": prefix,
               "shared_suffix_tokens": suffix, "C": C, "tol": TOL, "seconds": round(seconds, 1),
               "sites": rows, "best": best}
    (args.out / "probe_layers.json").write_text(json.dumps(results, indent=2))
    plot(rows, args.out / "probe_layers.png",
         f"{Path(info.model).name}: held-out AUROC ({len(train_set)} train, "
         f"{len(test_set)} test prompts; token positives: {args.positives})")
    print("\n" + report_table(rows))
    for readout, found in best.items():
        tied = f", {found['tied']} sites tie" if found["tied"] > 1 else ""
        print(f"[probe_layers] best {readout:>4}: {found['site']} (AUROC {found['auroc']:.4f}"
              f"{tied})")
    print(f"[probe_layers] wrote {args.out / 'probe_layers.json'}, "
          f"{args.out / 'probe_layers.png'} in {seconds:.0f} s (server start "
          f"{t_ready - t0:.0f} s)")
    return results


if __name__ == "__main__":
    main()
