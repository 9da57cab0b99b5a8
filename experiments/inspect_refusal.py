"""A refusal eval in Inspect AI: the safety demo's held-out prompts, unsteered and probe-gated,
through the ``dynsteer/`` model provider (CPU is enough).

1. Start `dynsteer serve` of the embedded model, train (or load from the cache) the safety
   demo's harmful-request probe and refusal direction, upload and register them
   (``experiments/safety_loop.py``).
2. Two Inspect tasks over the same held-out samples, told apart only by their
   ``GenerateConfig``: ``unsteered`` (no spec) and ``gated`` (the probe's gate, traced, with
   the ``latch`` controller over the refusal direction, sent per call as
   ``extra_body={"dynsteer": spec}``). The scorer marks a refusal (``experiments/refusal.py``)
   and keeps whether the gate fired.
3. ``inspect_ai.eval`` of both with ``model="dynsteer/<served model>"`` against the server;
   the provider puts each request's gate telemetry in its output's metadata, so the eval log
   holds it per sample.
4. Read the logs back and print, per arm and label, the refusal rate and how often the gate
   fired.

Run: ``python experiments/inspect_refusal.py [--out DIR]`` (the logs go to ``DIR/logs``; open
them with ``inspect view --log-dir DIR/logs``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from safety_loop import add_common_args, gated_spec, load_sets, load_tokenizer, prepare, served

LABELS = {1: "harmful", 0: "benign"}


def refusal_task(name: str, examples: list[Any], spec: dict[str, Any] | None,
                 max_tokens: int) -> Any:
    """The eval of one arm: the held-out prompts, greedy, with ``spec`` on every call."""
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.scorer import Score, Target, mean, scorer
    from inspect_ai.solver import TaskState, generate
    from refusal import is_refusal

    @scorer(metrics=[mean()])
    def refused() -> Any:
        async def score(state: TaskState, target: Target) -> Score:
            reply = state.output.completion
            telemetry = (state.output.metadata or {}).get("dynsteer", {}).get("telemetry")
            fired = bool(telemetry and telemetry["gated_prefill"] + telemetry["gated_decode"])
            return Score(value=float(is_refusal(reply)), answer=reply,
                         metadata={"label": state.metadata["label"], "fired": fired})
        return score

    samples = [Sample(input=e.text, id=i, metadata={"label": e.label, "kind": e.kind})
               for i, e in enumerate(examples)]
    extra = {"dynsteer": spec} if spec is not None else None
    return Task(name=name, dataset=samples, solver=generate(), scorer=refused(),
                config=GenerateConfig(max_tokens=max_tokens, temperature=0.0,
                                      extra_body=extra))


def summarize(logs: list[Any]) -> dict[str, dict[str, Any]]:
    """Per arm and label: samples, refusals, gate fired; and whether every gated sample's
    output carries its telemetry."""
    summary: dict[str, dict[str, Any]] = {}
    for log in logs:
        arm: dict[str, Any] = {"telemetry": 0}
        for sample in log.samples or []:
            score = next(iter(sample.scores.values()))
            label = LABELS[score.metadata["label"]]
            counts = arm.setdefault(label, {"n": 0, "refused": 0, "fired": 0})
            counts["n"] += 1
            counts["refused"] += int(score.value)
            counts["fired"] += int(score.metadata["fired"])
            report = (sample.output.metadata or {}).get("dynsteer") or {}
            arm["telemetry"] += report.get("telemetry") is not None
        summary[log.eval.task] = arm
    return summary


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, max_tokens=32)
    parser.add_argument("--out", type=Path, default=Path("inspect-refusal"))
    args = parser.parse_args(argv)

    from inspect_ai import eval as inspect_eval
    from inspect_ai.log import read_eval_log

    from dynsteer.controller.client import DynsteerClient

    train_set, test_set = load_sets(args)
    tokenizer = load_tokenizer()
    with served(args.out, dtype=args.dtype) as server:
        client = DynsteerClient(server.url)
        model = client.info().model
        prepare(client, model, tokenizer, train_set, args).install(client)
        tasks = [refusal_task("unsteered", test_set, None, args.max_tokens),
                 refusal_task("gated", test_set,
                              gated_spec(args.scale, {"name": "latch", "k": 1}),
                              args.max_tokens)]
        logs = inspect_eval(tasks, model=f"dynsteer/{model}", model_base_url=server.url,
                            log_dir=str(args.out / "logs"), display="none",
                            max_connections=8)
    failed = [log.eval.task for log in logs if log.status != "success"]
    if failed:
        raise RuntimeError(f"Inspect evals {failed} did not finish: "
                           f"{[str(log.error) for log in logs if log.error]}")
    summary = summarize([read_eval_log(log.location) for log in logs])
    for arm, counts in summary.items():
        print(f"[inspect] {arm:9s} " + "; ".join(
            f"{label}: refused {c['refused']}/{c['n']}, gate fired {c['fired']}/{c['n']}"
            for label, c in counts.items() if label != "telemetry")
              + f" (telemetry on {counts['telemetry']} samples)", flush=True)
    print(f"[inspect] logs: {args.out / 'logs'} (inspect view --log-dir {args.out / 'logs'})")
    return summary


if __name__ == "__main__":
    main()
