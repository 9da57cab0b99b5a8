"""The loop every safety experiment shares: a served model, a harmful-request probe, a refusal
direction, and chats sent through the ``openai`` client with a steering spec.

Everything goes over HTTP to a real `dynsteer serve` on loopback, as a deployment would:
activations come from ``POST /v1/dynsteer/capture``, the probe is uploaded, the directions are
registered as named vectors, and each chat's gate telemetry is read back per request.

The probe (:func:`train_probe`) is trained on *tokens*, as the gate reads them: each training
prompt followed by the model's own unsteered reply. Its positives are the chat template's
closing tokens of harmful requests (``<|im_end|>`` ... ``assistant``), where the model has
read the whole request; every other token, of either class and of the replies, is a negative.
Training on every token of a harmful request instead teaches the probe that "Write a" is
harmful, and it then fires on benign requests that share words with harmful ones; leaving the
replies out lets it fire while the model answers a benign request. Its threshold is chosen on
held-back training conversations (:func:`choose_threshold`).

The refusal direction (:func:`refusal_directions`) is a contrastive mean difference, per steered
layer: the activations of the model reading a refusal ("I'm sorry, but I can't help with
that.") after a harmful request, minus those of it reading a compliance ("Sure, here is what
you asked for.") after the same request. Added to the stream it makes the model refuse; the
difference between the two classes' *prompts* does not, on a model this small (it rarely
refuses on its own). The same capture gives each layer's *clamp target*: the mean projection of
the stream on the direction's unit vector while the model reads a refusal, the value a
``clamp`` entry (:func:`project_entries`) pins the stream to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harm_sources import (  # beside this file: a script's folder is first on its path
    TRAINING_PER_SOURCE,
    TRAINING_SOURCES,
    training_pool,
)
from safety_data import Example, balanced, load_labelled_jsonl, split

from dynsteer.engine_ext.default_model import cache_root

LAYER = 15
"""SmolLM2-135M (30 layers): the middle, where request intent is linearly readable
(`probe_layers.py` measures it by layer)."""
STEER_LAYERS = (15, 16, 17)
PROBE_NAME = "harmful-request"
REFUSALS = ("I'm sorry, but I can't help with that.", "I cannot help with this request.",
            "I'm sorry, I can't assist with that.")
COMPLIANCES = ("Sure, here is what you asked for.", "Sure! Here's how to do it.",
               "Of course, here are the steps.")
ARTIFACTS_VERSION = 4
"""Bump when what :func:`prepare` computes changes, so cached artifacts are not reused."""


def add_common_args(ap: argparse.ArgumentParser, *, train: int = 128, test: int = 24,
                    max_tokens: int = 48) -> None:
    """The data, probe and output arguments every safety experiment takes."""
    ap.add_argument("--prompts", type=Path, help="labelled JSONL ({text, label}) instead of "
                    "the training sources of harm_sources.py")
    ap.add_argument("--sources", default=",".join(TRAINING_SOURCES),
                    help="training sources of harm_sources.py, comma-separated "
                    "(advbench,benign: AdvBench against the repo's benign requests)")
    ap.add_argument("--per-source", type=int, default=TRAINING_PER_SOURCE,
                    help="prompts drawn from each source before the split (all of a smaller "
                    "one; 520 keeps every AdvBench prompt)")
    ap.add_argument("--train-per-label", type=int, default=train)
    ap.add_argument("--test-per-label", type=int, default=test)
    ap.add_argument("--fpr", type=float, default=0.0, help="fraction of held-back benign "
                    "training prompts allowed to fire the gate (0: none)")
    ap.add_argument("--sharpness", type=float, default=8.0,
                    help="gate = sigmoid(sharpness * (score - threshold))")
    ap.add_argument("--scale", type=float, default=0.35, help="multiplier of the direction")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=cache_root() / "demo",
                    help="where data, probes and directions are cached")
    ap.add_argument("--dtype", default="auto",
                    help="the served model's dtype (vLLM's --dtype; auto: vLLM's choice, "
                    "bfloat16 for the embedded model). float32 is several times faster on a "
                    "CPU without bfloat16 instructions (AVX2 only); the tests use it")


def progress(items: Any, desc: str, total: int | None = None) -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr)


def load_sets(args: argparse.Namespace) -> tuple[list[Example], list[Example]]:
    """(train, test): the fixed split for ``--seed``, balanced per label."""
    examples = (load_labelled_jsonl(args.prompts) if args.prompts
                else training_pool(args.cache / "data", args.seed, args.per_source,
                                   args.sources.split(",")))
    train_set, test_set = split(examples, seed=args.seed)
    return (balanced(train_set, args.train_per_label, seed=args.seed),
            balanced(test_set, args.test_per_label, seed=args.seed))


def load_tokenizer() -> Any:
    """The embedded model's tokenizer (the one the server applies its chat template with)."""
    import transformers

    from dynsteer.engine_ext.default_model import default_model_path

    return transformers.AutoTokenizer.from_pretrained(default_model_path())


def chat_ids(tokenizer: Any, text: str, reply: str = "") -> list[int]:
    """The token ids the server's chat route feeds the model for one user turn (and, with
    ``reply``, the start of the assistant's answer)."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(chat + reply, add_special_tokens=False)["input_ids"])


def shared_prefix(ids: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with (the chat template before the user's words)."""
    n = min(len(i) for i in ids)
    return next((p for p in range(n) if len({i[p] for i in ids}) > 1), n)


def shared_suffix(ids: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt ends with (the chat template after the user's words)."""
    return shared_prefix([list(reversed(i)) for i in ids])


@contextmanager
def served(out: Path, options: dict[str, Any] | None = None,
           dtype: str = "auto") -> Iterator[Any]:
    """A ready `dynsteer serve` of the embedded model whose monitor sites cover the probe and
    the steered layers, with more engine ``options`` if given, in ``dtype`` (``--dtype``;
    auto: vLLM's choice). vLLM's log goes to ``out/serve.log``."""
    from tqdm import tqdm

    from dynsteer.controller.launch import ServerProcess

    sites = f"post_block@{min(LAYER, *STEER_LAYERS)}-{max(LAYER, *STEER_LAYERS)}"
    config = {"dynsteer": {"monitor_sites": sites, **(options or {})}}
    args = ["--max-model-len", "1024", "--additional-config", json.dumps(config)]
    if dtype != "auto":
        args += ["--dtype", dtype]
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with ServerProcess(args, out / "serve.log") as server:
        print(f"[safety] starting dynsteer serve (log: {server.log})", flush=True)
        with tqdm(desc="starting dynsteer serve", bar_format="{desc} {elapsed} {postfix}",
                  leave=False, file=sys.stderr) as bar:
            server.wait_ready(on_wait=lambda line: bar.set_postfix_str(_log_message(line)))
        print(f"[safety] server ready after {time.time() - started:.0f} s", flush=True)
        yield server


def _log_message(line: str, width: int = 60) -> str:
    """The message part of a vLLM log line, cut to ``width`` (the postfix of a progress
    bar): what the server is doing while it starts."""
    message = line.split("] ", 1)[-1].strip()
    return message if len(message) <= width else message[: width - 1] + "…"


def capture(client: Any, ids: Sequence[Sequence[int]], sites: Sequence[str],
            batch: int = 16, desc: str = "capture") -> dict[str, list[np.ndarray]]:
    """Every token's activations ``[len_i, H]`` per prompt at each site."""
    out: dict[str, list[np.ndarray]] = {site: [] for site in sites}
    for start in progress(range(0, len(ids), batch), desc, total=-(-len(ids) // batch)):
        for site, got in client.capture(ids[start:start + batch], list(sites),
                                        reduce="all").items():
            out[site].extend(got)
    return out


def train_probe(streams: Sequence[np.ndarray], prompt_lengths: Sequence[int],
                labels: np.ndarray, suffix: int, args: argparse.Namespace,
                metadata: dict[str, str]) -> Any:
    """A token-level probe at :data:`LAYER` whose positives are the closing ``suffix`` tokens
    of harmful prompts (see the module docstring), fit on 70% of the conversations (prompt
    and reply), with the threshold :func:`choose_threshold` picks on the other 30%."""
    from sklearn.linear_model import LogisticRegression

    from dynsteer.probes import from_sklearn

    fit = np.random.default_rng(args.seed).random(len(streams)) < 0.7
    token_labels = [np.r_[np.zeros(n - suffix), np.full(suffix, y), np.zeros(len(s) - n)]
                    for s, n, y in zip(streams, prompt_lengths, labels, strict=True)]
    classifier = LogisticRegression(C=0.01, max_iter=5000, class_weight="balanced").fit(
        np.concatenate([s for s, f in zip(streams, fit, strict=True) if f]),
        np.concatenate([t for t, f in zip(token_labels, fit, strict=True) if f]))
    probe = from_sklearn(classifier, layer=LAYER, name=PROBE_NAME, metadata=metadata)
    probe = probe.replace(sharpness=args.sharpness)
    # A conversation fires if any of its tokens does: each held-back one is its peak token.
    peaks = [s[np.argmax(probe.score(s))] for s, f in zip(streams, fit, strict=True) if not f]
    held_labels = labels[~fit]
    return choose_threshold(probe, np.stack(peaks), held_labels, args.fpr)


def choose_threshold(probe: Any, peaks: np.ndarray, labels: np.ndarray, fpr: float) -> Any:
    """The probe with its threshold in the middle of the gap between the classes' held-back
    peak tokens: above what ``fpr`` of the benign conversations reach (calibration), and
    halfway to the lowest harmful peak when that is higher. The midpoint leaves equal room
    for new benign conversations that score a little higher than any seen and for harmful
    ones that score a little lower, where the calibrated bar alone sits at the edge of the
    benign scores and lets the next benign outlier fire."""
    from dynsteer.probes import calibrate_threshold

    calibrated = calibrate_threshold(probe, peaks[labels == 0], fpr)
    harmful = probe.score(peaks[labels == 1])
    if harmful.size == 0 or harmful.min() <= calibrated.threshold:
        return calibrated
    return calibrated.replace(threshold=float(calibrated.threshold + harmful.min()) / 2)


def refusal_directions(client: Any, tokenizer: Any, harmful: Sequence[str]
                       ) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """Per steered layer: the refusal direction, mean activation over the tokens of a refusal
    minus over those of a compliance, each read after the same harmful request (see the module
    docstring); and the clamp target, the refusal mean's projection on the direction's unit
    vector (the mean projection of the stream reading a refusal)."""
    refusal = _reply_means(client, tokenizer, harmful, REFUSALS, "refusals")
    compliance = _reply_means(client, tokenizer, harmful, COMPLIANCES, "compliances")
    directions = {layer: (refusal[layer] - compliance[layer]).astype(np.float32)
                  for layer in STEER_LAYERS}
    targets = {layer: float(refusal[layer] @ v / np.linalg.norm(v))
               for layer, v in directions.items()}
    return directions, targets


def _reply_means(client: Any, tokenizer: Any, harmful: Sequence[str], replies: Sequence[str],
                 desc: str) -> dict[int, np.ndarray]:
    """Per steered layer: the stream's mean over each of ``replies``' tokens read after each
    ``harmful`` request, averaged over the (request, reply) pairs."""
    sites = [f"post_block@{layer}" for layer in STEER_LAYERS]
    ids = [chat_ids(tokenizer, text, reply) for text in harmful for reply in replies]
    lengths = [len(tokenizer(reply, add_special_tokens=False)["input_ids"])
               for _ in harmful for reply in replies]
    got = capture(client, ids, sites, desc=f"capture (refusal direction, {desc})")
    return {layer: np.stack([a[-n:].mean(0) for a, n in zip(got[site], lengths, strict=True)]
                            ).mean(0)
            for layer, site in zip(STEER_LAYERS, sites, strict=True)}


@dataclass(frozen=True)
class Artifacts:
    """What training produces: the probe, the refusal direction per steered layer and each
    direction's clamp target (:func:`refusal_directions`)."""

    probe: Any
    directions: dict[int, np.ndarray]
    targets: dict[int, float]

    def install(self, client: Any) -> None:
        """Upload the probe and register each direction as ``refusal-lLAYER``."""
        client.upload_probe(self.probe, replace=True)
        for layer, vector in self.directions.items():
            client.register_vector(f"refusal-l{layer}", vector, replace=True)


def prepare(client: Any, model: str, tokenizer: Any, train_set: Sequence[Example],
            args: argparse.Namespace) -> Artifacts:
    """Train (or load from ``args.cache``) the probe, the refusal directions and their clamp
    targets; ``model`` is the served model's name (the training prompts' replies come from
    it)."""
    from dynsteer.probes import Probe

    settings = [ARTIFACTS_VERSION, [[e.text, e.label] for e in train_set], LAYER, STEER_LAYERS,
                args.fpr, args.sharpness, args.seed, args.max_tokens]
    if args.dtype != "auto":  # the served dtype changes the activations (auto keeps older keys)
        settings.append(args.dtype)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = args.cache / key
    if (folder / "probe.safetensors").exists():
        targets = json.loads((folder / "targets.json").read_text())
        with np.load(folder / "directions.npz") as saved:
            return Artifacts(Probe.load(folder / "probe.safetensors"),
                             {int(k): saved[k] for k in saved.files},
                             {int(k): float(v) for k, v in targets.items()})
    prompts = [chat_ids(tokenizer, e.text) for e in train_set]
    replies = run_chats(client.base_url, model, [e.text for e in train_set], None,
                        args.max_tokens, "replies (probe training)")
    ids = [p + tokenizer(c.reply, add_special_tokens=False)["input_ids"]
           for p, c in zip(prompts, replies, strict=True)]
    labels = np.array([e.label for e in train_set])
    site = f"post_block@{LAYER}"
    streams = capture(client, ids, [site], desc="capture (probe)")[site]
    source = str(args.prompts) if args.prompts else f"harm_sources:{args.sources}"
    probe = train_probe(streams, [len(p) for p in prompts], labels, shared_suffix(prompts),
                        args, {"data": source})
    directions, targets = refusal_directions(client, tokenizer,
                                             [e.text for e in train_set if e.label == 1][:32])
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "directions.npz", **{str(k): v for k, v in directions.items()})
    (folder / "targets.json").write_text(json.dumps(targets))
    probe.save(folder / "probe.safetensors")  # last: its presence marks the folder complete
    return Artifacts(probe, directions, targets)


def steer_entries(scale: float, layers: Sequence[int] = STEER_LAYERS) -> list[dict[str, Any]]:
    """One entry per steered layer, each adding that layer's refusal direction."""
    return [{"vector": f"refusal-l{layer}", "layers": [layer], "scale": scale}
            for layer in layers]


def project_entries(op: str, values: Mapping[int, float] | None = None, scale: float = 1.0,
                    layers: Sequence[int] = STEER_LAYERS) -> list[dict[str, Any]]:
    """One entry per steered layer that, instead of adding the refusal direction, acts on the
    stream's projection on it: ``ablate`` removes it, ``clamp`` pins it to ``values[layer]``
    (the :attr:`Artifacts.targets`). Adding moves every token the same distance whatever it
    already holds, so a fixed scale overshoots on tokens that already lean towards refusal and
    undershoots on others; a projection sets where each token ends up. Such entries need a
    server started with ``max_projections`` >= the entries per site (one here)."""
    return [{**entry, "op": op, **({} if values is None else {"value": values[layer]})}
            for entry, layer in zip(steer_entries(scale, layers), layers, strict=True)]


def gated_spec(steer: float | Sequence[dict[str, Any]], controller: dict[str, Any] | None = None,
               **gate: Any) -> dict[str, Any]:
    """The probe's gate (traced, so per-token gates come back) over ``steer``: entries, or a
    scale for :func:`steer_entries` (the refusal direction added at every steered layer);
    ``gate`` overrides the gate's other fields (threshold, sharpness)."""
    entries = steer_entries(steer) if isinstance(steer, float | int) else list(steer)
    spec: dict[str, Any] = {"gate": {"probe": PROBE_NAME, "layer": LAYER, "trace": True,
                                     "steer": entries, **gate}}
    if controller:
        spec["controller"] = controller
    return spec


@dataclass(frozen=True)
class Chat:
    """One chat completion: the server's response id (for its telemetry) and the reply."""

    id: str
    reply: str
    completion_tokens: int


def run_chats(base_url: str, model: str, texts: Sequence[str], spec: dict[str, Any] | None,
              max_tokens: int, desc: str, concurrency: int = 8) -> list[Chat]:
    """Greedy chats, ``concurrency`` in flight (the engine batches them), in input order."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=2)

    def one(text: str) -> Chat:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=0.0, extra_body={"dynsteer": spec} if spec else None)
        usage = response.usage
        return Chat(response.id, response.choices[0].message.content or "",
                    usage.completion_tokens if usage else 0)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(progress(pool.map(one, texts), desc, total=len(texts)))


def first_gated(gates: Sequence[float | None]) -> int | None:
    return next((i for i, g in enumerate(gates) if g is not None and g > 0.5), None)


def steered_tokens(gates: Sequence[float | None]) -> int:
    return sum(1 for g in gates if g is not None and g > 0.5)
