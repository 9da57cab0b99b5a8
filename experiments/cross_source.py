"""Does the harmful-request probe generalize beyond the sources it was trained on?

A probe read by a gate must fire on harm however it is phrased. This trains the demo's kind of
probe (``safety_loop.train_probe``: token positives at the chat template's closing tokens of
harmful prompts, every other token a negative, threshold midway between the classes' held-back
peaks) under several training recipes and reports how often it fires, per *source* and per
*phrasing*, on prompts it never saw:

* ``advbench``: AdvBench against the repo's benign set, the demo's original recipe;
* ``mixed``: every training source of ``harm_sources`` (imperatives and questions, several
  harm sources, benign questions of the same shapes);
* ``mixed - S``: the mixed recipe without harmful source ``S``, evaluated on ``S`` (each
  harmful training source held out in turn).

Evaluated on: the held-out part (``--test-fraction``) of every training source, and all of
HarmBench and Do-Not-Answer, which no recipe trains or chooses a threshold on. Per source: how
many prompts fire (TPR for harmful sources, FPR for benign ones) and the AUROC of the source's
harmful prompts against every held-out benign prompt; per phrasing (question / imperative) the
same. A prompt fires if its highest-scoring prompt token passes the threshold (the gate fires if
any token does; replies are not generated here). A threshold sweep of the ``mixed`` and
``advbench`` recipes goes to ``cross_source.png``; with ``--layers`` holding several layers, a
per-layer AUROC of harmful against benign *questions* (held out) says whether the model
represents harm in question form anywhere.

Activations come from a real `dynsteer serve` of the embedded model (``POST
/v1/dynsteer/capture``), chat-templated as the server feeds them. CPU is enough (~5 minutes).

Run: ``python experiments/cross_source.py [--per-source 120] [--layers 15] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harm_sources import SOURCES, held_out_source, load_sources, per_source, phrasing
from safety_data import Example

HELD_OUT_HARM = ("advbench", "past_tense", "future_tense")
"""The harmful training sources each held out in turn (``mixed - S``)."""
EVAL_ONLY = tuple(name for name, s in SOURCES.items() if s.role == "eval")
BASE_RECIPE = ("advbench", "benign")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dynsteer.engine_ext.default_model import cache_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-source", type=int, default=120,
                    help="prompts drawn from each source (all of a smaller one)")
    ap.add_argument("--test-fraction", type=float, default=0.3,
                    help="held-out part of each training source")
    ap.add_argument("--layers", default="15",
                    help="post_block layers to probe, comma-separated; the first is the gate's")
    ap.add_argument("--sharpness", type=float, default=8.0)
    ap.add_argument("--fpr", type=float, default=0.0,
                    help="held-back benign training prompts allowed to fire (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=cache_root() / "demo",
                    help="where the source wheels are cached (shared with the demo)")
    ap.add_argument("--out", type=Path, default=Path("cross-source-output"))
    return ap.parse_args(argv)


@dataclass(frozen=True)
class Split:
    """The training pool's train side, and every prompt evaluated (held-out parts of the
    training sources, all of the evaluation-only ones)."""

    train: list[Example]
    test: list[Example]


def make_split(examples: Sequence[Example], test_fraction: float, seed: int) -> Split:
    """Each training source split on its own (round(n * test_fraction) of its n prompts held
    out, drawn with default_rng(seed)), so every source has a held-out part; the
    evaluation-only sources entirely on the test side. Both sides keep the input order."""
    rng = np.random.default_rng(seed)
    kinds = np.array([e.kind for e in examples])
    in_test = np.zeros(len(examples), dtype=bool)
    for name, source in SOURCES.items():
        mine = np.flatnonzero(kinds == name)
        held = len(mine) if source.role == "eval" else round(len(mine) * test_fraction)
        in_test[rng.permutation(mine)[:held]] = True
    return Split([e for e, t in zip(examples, in_test, strict=True) if not t],
                 [e for e, t in zip(examples, in_test, strict=True) if t])


def recipes(data: Split) -> dict[str, tuple[list[Example], list[str]]]:
    """Recipe name -> (its training examples, the sources it is evaluated on)."""
    everything = sorted({e.kind for e in data.test})
    out = {"advbench": ([e for e in data.train if e.kind in BASE_RECIPE], everything),
           "mixed": (list(data.train), everything)}
    for name in HELD_OUT_HARM:
        train, _ = held_out_source(data.train, name)
        out[f"mixed - {name}"] = (train, [name])
    return out


def fired_rates(peaks: np.ndarray, threshold: float, examples: Sequence[Example]
                ) -> dict[str, Any]:
    """Per source and per (label, phrasing): prompts that fire, of how many, and the AUROC of
    the harmful ones against every benign one evaluated."""
    from sklearn.metrics import roc_auc_score

    labels = np.array([e.label for e in examples])
    kinds = np.array([e.kind for e in examples])
    shapes = np.array([phrasing(e.text) for e in examples])
    fired = peaks > threshold
    benign = labels == 0

    def group(mask: np.ndarray) -> dict[str, Any]:
        row: dict[str, Any] = {"fired": int(fired[mask].sum()), "n": int(mask.sum())}
        if labels[mask].all() and benign.any():
            both = mask | benign
            row["auroc"] = float(roc_auc_score(labels[both], peaks[both]))
        return row

    return {
        "sources": {k: group(kinds == k) for k in dict.fromkeys(kinds)},
        "phrasing": {f"{'harmful' if y else 'benign'} {s}": group((labels == y) & (shapes == s))
                     for y in (1, 0) for s in ("question", "imperative")
                     if ((labels == y) & (shapes == s)).any()},
    }


def peak_scores(probe: Any, streams: Sequence[np.ndarray]) -> np.ndarray:
    """Each prompt's highest token score (the gate fires if any token passes)."""
    return np.array([float(probe.score(s).max()) for s in streams])


def train(streams: dict[str, np.ndarray], examples: Sequence[Example], suffix: int,
          args: argparse.Namespace) -> Any:
    """The demo's probe (:func:`safety_loop.train_probe`) on prompt tokens only (its site
    says the demo's layer; only its scores are used here)."""
    from safety_loop import train_probe

    chosen = [streams[e.text] for e in examples]
    return train_probe(chosen, [len(s) for s in chosen], np.array([e.label for e in examples]),
                       suffix, args, {"data": "cross_source"})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from safety_loop import capture, chat_ids, load_tokenizer, shared_suffix

    from dynsteer.controller.client import DynsteerClient
    from dynsteer.controller.launch import ServerProcess

    t0 = time.time()
    layers = [int(x) for x in args.layers.split(",")]
    examples = per_source(load_sources(args.cache / "data"), args.per_source, args.seed)
    data = make_split(examples, args.test_fraction, args.seed)
    print(f"[cross_source] {len(data.train)} training prompts, {len(data.test)} evaluated; "
          f"sources: {', '.join(dict.fromkeys(e.kind for e in examples))}", flush=True)
    tokenizer = load_tokenizer()
    everyone = [*data.train, *data.test]
    ids = [chat_ids(tokenizer, e.text) for e in everyone]
    suffix = shared_suffix(ids)
    sites = [f"post_block@{layer}" for layer in layers]
    config = {"dynsteer": {"sites": ",".join(sites), "monitor_sites": ",".join(sites),
                           "capture_lanes": len(sites)}}
    args.out.mkdir(parents=True, exist_ok=True)
    with ServerProcess(["--max-model-len", "1024", "--additional-config", json.dumps(config)],
                       args.out / "serve.log") as server:
        print(f"[cross_source] starting dynsteer serve (log: {server.log}) ...", flush=True)
        server.wait_ready()
        got = capture(DynsteerClient(server.url, timeout=600), ids, sites, args.batch)
    by_layer = {layer: {e.text: s for e, s in zip(everyone, got[site], strict=True)}
                for layer, site in zip(layers, sites, strict=True)}
    results: dict[str, Any] = {"layers": layers, "per_source": args.per_source,
                               "train": len(data.train), "test": len(data.test),
                               "seed": args.seed, "recipes": {}}
    gate_layer = layers[0]
    sweeps = {}
    for name, (train_set, evaluated) in recipes(data).items():
        probe = train(by_layer[gate_layer], train_set, suffix, args)
        test = [e for e in data.test if e.kind in evaluated or e.label == 0]
        peaks = peak_scores(probe, [by_layer[gate_layer][e.text] for e in test])
        results["recipes"][name] = {"threshold": probe.threshold, "train": len(train_set),
                                    **fired_rates(peaks, probe.threshold, test)}
        if name in ("advbench", "mixed"):
            sweeps[name] = (probe.threshold, peaks, test)
    if len(layers) > 1:
        results["question_auroc_by_layer"] = question_auroc_by_layer(by_layer, data, suffix,
                                                                     args)
    results["seconds"] = round(time.time() - t0, 1)
    (args.out / "cross_source.json").write_text(json.dumps(results, indent=2))
    plot_thresholds(sweeps, args.out / "cross_source.png")
    print("\n" + report(results))
    print(f"[cross_source] wrote {args.out / 'cross_source.json'}, "
          f"{args.out / 'cross_source.png'} in {results['seconds']:.0f} s")
    return results


def question_auroc_by_layer(by_layer: dict[int, dict[str, np.ndarray]], data: Split,
                            suffix: int, args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Per layer and recipe: the held-out AUROC of harmful against benign *questions* (every
    evaluated source), the question a model that cannot represent harm in question form
    fails at every layer."""
    from sklearn.metrics import roc_auc_score

    questions = [e for e in data.test if phrasing(e.text) == "question"]
    labels = np.array([e.label for e in questions])
    out: dict[str, dict[int, float]] = {}
    for name, (train_set, _) in list(recipes(data).items())[:2]:
        out[name] = {}
        for layer, streams in by_layer.items():
            probe = train(streams, train_set, suffix, args)
            peaks = peak_scores(probe, [streams[e.text] for e in questions])
            out[name][layer] = float(roc_auc_score(labels, peaks))
    return out


def plot_thresholds(sweeps: dict[str, tuple[float, np.ndarray, list[Example]]],
                    path: Path) -> None:
    """Per recipe: the fraction of each evaluated source that fires against the threshold's
    offset from the chosen one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4), squeeze=False)
    offsets = np.linspace(-4, 4, 81)
    for ax, (name, (threshold, peaks, test)) in zip(axes[0], sweeps.items(), strict=True):
        kinds = np.array([e.kind for e in test])
        for kind in dict.fromkeys(kinds):
            mine = peaks[kinds == kind]
            style = "--" if SOURCES[kind].label == 0 else "-"
            ax.plot(offsets, [(mine > threshold + o).mean() for o in offsets], style,
                    label=f"{kind}{' (eval only)' if kind in EVAL_ONLY else ''}")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"recipe {name}: threshold {threshold:.2f}")
        ax.set_xlabel("threshold - chosen threshold")
        ax.set_ylabel("fraction of prompts that fire")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _cell(row: dict[str, Any]) -> str:
    auroc = f"  AUROC {row['auroc']:.2f}" if "auroc" in row else ""
    return f"{row['fired']:>4}/{row['n']:<4}{auroc}"


def report(results: dict[str, Any]) -> str:
    """The per-recipe tables: fired / evaluated (and AUROC) per source and per phrasing."""
    lines = []
    for name, got in results["recipes"].items():
        lines.append(f"recipe {name} ({got['train']} training prompts, threshold "
                     f"{got['threshold']:.2f}): prompts that fire")
        for kind, row in got["sources"].items():
            role = "eval only" if kind in EVAL_ONLY else "held out"
            label = "harmful" if SOURCES[kind].label else "benign"
            lines.append(f"  {kind:<14}{label:<9}{role:<11}{_cell(row)}")
        for shape, row in got["phrasing"].items():
            lines.append(f"  {shape:<34}{_cell(row)}")
    for name, by_layer in results.get("question_auroc_by_layer", {}).items():
        lines.append(f"questions, harmful vs benign AUROC by layer ({name}): " + ", ".join(
            f"{layer}: {auroc:.2f}" for layer, auroc in by_layer.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
