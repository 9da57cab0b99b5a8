"""Throughput of dynsteer on serving-like traffic against stock vLLM, side by side (GPU).

A Llama-8B-shaped model with dummy weights (bf16, CUDA graphs and torch.compile on, vLLM
defaults otherwise) in two engines that live at the same time: ``stock`` (plugin installed, not
enabled) and ``plugin`` (enabled, default sites: ``post_block`` at all 32 layers). Runs
alternate between scenarios (order reversed every repetition), so drift hits all alike.

Scenarios, each request of a batch carrying its own spec:

* ``idle``        the plugin engine without steering traffic;
* ``registered``  every request steered by one registered vector at layer 16;
* ``registered-null``  the same with the vector scaled by 1e-30: the same loads and adds, but
                  every sum rounds back to the residual's bf16 value, so the engine computes
                  stock's numbers. At batch 256 the H100 runs at its power limit and its clock
                  follows the data (:class:`SmClock`); this run measures the steering's cost
                  without that confound;
* ``inline-32``   32 distinct inline vectors (JSON float lists), request i uses vector i % 32;
* ``inline-32-b64``  the same vectors as base64 float32 (``vector_b64``, the fast form);
* ``dict-16``     16 distinct inline vectors as Python float lists in a dict spec, a new dict per
                  request (``extra_args={"dynsteer": {"steer": [{"vector": v.tolist(), ...}]}}``,
                  as the Python usage shows it);
* ``dict-16-b64`` the same dicts with the vectors as ``vector_b64``;
* ``gated``       a registered probe at ``post_block@16`` gating a registered vector at layers
                  16-23 (threshold at the median score, so the gate fires on about half the
                  tokens; the measured fraction is reported);
* ``gates-32``    32 distinct gates (distinct inline probes), each gating that vector;
* ``latch``       ``gated`` with the built-in ``latch`` controller (k=4) on every request;
* ``python``      ``gated`` with a Python controller on every request (a numpy latch, loaded
                  through the entry point, :mod:`bench_controllers`);
* ``events``      ``gated`` on a third engine that publishes controller events every step to a
                  live ZeroMQ subscriber in this process (events counted and reported);
* ``ablate``      every request ablating one registered direction at layers 16-23, on an engine
                  of its own with one projection slot (``max_projections: 1``);
* ``positions``   ``registered`` on the last prompt token and every generated one only
                  (``"positions": [-1, "g0:"]``): the per-token index by position;
* ``norm-match``  every request adding the registered vector at layers 16-23 scaled to the
                  stream's norm (``norm_match``, scale 0.05), on the projection-slot engine.

With ``--variant JSON`` a ``variant`` engine (the plugin with those engine options, e.g.
``'{"max_rows": 256}'``) runs every scenario the ``plugin`` engine runs, in the same
alternation, and each of its rows is also compared with the ``plugin`` row of its scenario
(``vs plugin``): an engine option against the default in one run.

Two engines of one build differ by up to 0.4-0.5% of a batch-1 decode step, either way round,
as much as a 0.5% target's margin. ``--instances K`` starts stock, plugin and
variant K times each, every other round in reverse order (ABBA for K=2, so a bias by start
order cancels; later instances are named ``plugin#2`` and so on), runs every instance, and adds
a ``pooled`` row per scenario: the mean decode step of the stock instances over that of the
plugin's (:func:`pooled`; also the variant's against the stock's and the plugin's). With
``--variant '{}' --control`` (one instance each) the variant counts as a second plugin
instance and the control as a second stock one, in the same order.

With ``--tp N`` every engine is tensor-parallel over N GPUs, started with the settings of
:mod:`tp_settings` (issue 18's overhead table at TP=2).

Shapes: decode-heavy (128 prompt + 128 generated tokens) at batches 1, 32, 256 and a
prefill-heavy one (2048 prompt + 16 generated) at batch 32. ``--traffic`` adds traffic that
repeats prefixes, as chat traffic does, at the same batches (every engine keeps its prefix
cache on, so stock serves the repeats from it): ``shared``, a 1024-token system prompt shared
by every request of the shape plus 128 tokens of its own; ``resend``, a two-turn conversation
whose second turn resends the first (its prompt and 128 generated tokens) plus 64 new tokens,
the second turn timed (the first runs just before it, untimed). ``fresh`` is the default
shape above, new random prompts every run. Prints a table (tokens/s = generated
tokens / wall time, median of the repetitions, ratio to stock in the same run, spread; the
median decode step by vLLM's own step timestamps (:class:`StepClock`), its ratio to stock's and
the range of the per-repetition ratios, the mean SM clock and the ratio of cycles per decode
step (:class:`SmClock`); for plugin
runs the worker's dynsteer host time per step: index fill + telemetry fold and report, and per
admitted request, and the steps whose index the device filled, the host filled or the device
path kept) and writes ``overhead.json``.

Usage: python benchmarks/overhead.py --out DIR [--batches 1 32 256] [--reps 4] [--no-prefill]
       [--scenarios idle gated ...] [--traffic fresh shared resend] [--control]
       [--variant JSON] [--mem 0.3] [--instances 2] [--tp 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_model import dummy_model, memory_need_gib
from sigterm import exits_on_sigterm
from tp_settings import GPU_TP_ENV, GPU_TP_KWARGS

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
}
HIDDEN = LLAMA_8B["hidden_size"]
DECODE = (128, 128)
PREFILL = (2048, 16)
MONITOR = 16
GATED_LAYERS = list(range(16, 24))
DISTINCT = 32
DICT_DISTINCT = 16
SCENARIOS = ["idle", "registered", "registered-null", "inline-32", "inline-32-b64", "dict-16",
             "dict-16-b64", "gated", "gates-32", "latch", "python", "events", "ablate",
             "positions", "norm-match"]
DICT_SCENARIOS = ("dict-16", "dict-16-b64")
"""Scenarios whose specs are handed over as Python dicts (the others as JSON text)."""
TRAFFIC = ("fresh", "shared", "resend")
SYSTEM_PROMPT = 1024
"""Tokens of the system prompt every request of a ``shared`` shape starts with."""
TURN = 128
"""Tokens of a request's own turn (``shared``: after the system prompt; ``resend``: the first
turn's prompt and its generated tokens)."""
FOLLOW_UP = 64
"""New tokens of the second turn of a ``resend`` conversation."""
OWN_ENGINE = {"events": "events", "ablate": "projecting", "norm-match": "projecting"}
"""Scenarios that run on an engine of their own (others run on ``plugin``)."""
REPEATED = ("stock", "plugin", "variant")
"""The engines ``--instances`` starts more than once."""
EVENTS_ADDRESS = "tcp://127.0.0.1:5599"
NULL_SCALE = 1e-30
"""The ``registered-null`` vector's scale: far below half a bf16 ulp of any residual value the
model makes, far above float32's smallest normal number."""



def make_model() -> Path:
    """The Llama-8B-shaped dummy model (:mod:`bench_model`: a path that keeps vLLM's compile
    cache from call to call)."""
    return dummy_model("llama8b", LLAMA_8B)


def start(path: Path, dynsteer: dict[str, Any] | None, mem: float, tp: int = 1) -> Any:
    """One engine; ``tp`` > 1 starts it with the TP settings of :mod:`tp_settings` (their
    environment is set in this process, which the workers inherit)."""
    from vllm import LLM

    parallel: dict[str, Any] = {}
    if tp > 1:
        os.environ.update(GPU_TP_ENV)
        parallel = {"tensor_parallel_size": tp, **GPU_TP_KWARGS}
    extra = {"additional_config": {"dynsteer": dynsteer}} if dynsteer is not None else {}
    return LLM(str(path), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
               max_model_len=PREFILL[0] + PREFILL[1] + 16, max_num_seqs=256,
               gpu_memory_utilization=mem, seed=0, **parallel, **extra)


class Specs:
    """The per-request specs of every scenario (built once, outside the timed region)."""

    def __init__(self, threshold: float) -> None:
        import numpy as np

        from dynsteer.controller.contract import encode_f32

        rng = np.random.default_rng(1)
        vectors = rng.standard_normal((DISTINCT, HIDDEN)).astype(np.float32) * 0.01
        probes = rng.standard_normal((DISTINCT, HIDDEN)).astype(np.float32) / HIDDEN**0.5
        gated = [{"vector": "bench", "layers": GATED_LAYERS}]
        self.by_scenario: dict[str, list[Any]] = {
            "idle": [None],
            "registered": [{"steer": [{"vector": "bench", "layers": [MONITOR]}]}],
            "registered-null": [{"steer": [{"vector": "null", "layers": [MONITOR]}]}],
            "inline-32": [{"steer": [{"vector": v.tolist(), "layers": [MONITOR]}]}
                          for v in vectors],
            "inline-32-b64": [{"steer": [{"vector_b64": encode_f32(v), "layers": [MONITOR]}]}
                              for v in vectors],
            "dict-16": [{"steer": [{"vector": v.tolist(), "layers": [MONITOR]}]}
                        for v in vectors[:DICT_DISTINCT]],
            "dict-16-b64": [{"steer": [{"vector_b64": encode_f32(v), "layers": [MONITOR]}]}
                            for v in vectors[:DICT_DISTINCT]],
            "gated": [{"gate": {"probe": "bench", "layer": MONITOR, "steer": gated}}],
            "latch": [{"gate": {"probe": "bench", "layer": MONITOR, "steer": gated},
                       "controller": {"name": "latch", "k": 4}}],
            "python": [{"gate": {"probe": "bench", "layer": MONITOR, "steer": gated},
                        "controller": {"name": "bench-latch"}}],
            "gates-32": [{"gate": {"probe": {"weights_b64": encode_f32(p),
                                             "threshold": threshold},
                                   "layer": MONITOR, "steer": gated}} for p in probes],
        }
        self.by_scenario["events"] = self.by_scenario["gated"]
        self.by_scenario["ablate"] = [{"steer": [{"vector": "bench", "layers": GATED_LAYERS,
                                                  "op": "ablate"}]}]
        self.by_scenario["positions"] = [{"steer": [{"vector": "bench", "layers": [MONITOR],
                                                     "positions": [-1, "g0:"]}]}]
        self.by_scenario["norm-match"] = [{"steer": [{"vector": "bench", "layers": GATED_LAYERS,
                                                      "scale": 0.05, "norm_match": True}]}]

    def params(self, scenario: str, batch: int, gen_len: int) -> list[Any]:
        """One ``SamplingParams`` per request: the spec as a JSON string, as the OpenAI
        server's ``vllm_xargs`` carries it, or (:data:`DICT_SCENARIOS`) as a new dict per
        request, as Python code builds it."""
        from vllm import SamplingParams

        specs = self.by_scenario[scenario]
        as_dict = scenario in DICT_SCENARIOS
        forms = [s if s is None or as_dict else json.dumps(s) for s in specs]

        def spec(i: int) -> Any:
            form = forms[i % len(forms)]
            return copy.deepcopy(form) if as_dict else form

        return [SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True,
                               detokenize=False,
                               extra_args=None if forms[i % len(forms)] is None
                               else {"dynsteer": spec(i)})
                for i in range(batch)]


def prompts(batch: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    """Random prompts; every timed run gets its own seed, so no run is served from the prefix
    cache (which would favour whichever engine kept the previous run's blocks)."""
    import numpy as np

    rng = np.random.default_rng([batch, length, seed])
    return [{"prompt_token_ids": rng.integers(100, 30000, length).tolist()} for _ in range(batch)]


def shared_prompts(batch: int, seed: int) -> list[dict[str, Any]]:
    """The ``shared`` traffic: one system prompt for every request and run of the batch size,
    then each request's own turn (new every run)."""
    system = prompts(1, SYSTEM_PROMPT, seed=1_000_000 + batch)[0]["prompt_token_ids"]
    return [{"prompt_token_ids": system + p["prompt_token_ids"]}
            for p in prompts(batch, TURN, seed)]


def second_turns(first: list[dict[str, Any]], outputs: list[Any],
                 seed: int) -> list[dict[str, Any]]:
    """The ``resend`` traffic's timed turn: each conversation's first prompt, what it
    generated, then :data:`FOLLOW_UP` new tokens."""
    new = prompts(len(first), FOLLOW_UP, seed)
    return [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids)
             + n["prompt_token_ids"]} for p, o, n in zip(first, outputs, new, strict=True)]


def traffic_prompts(llm: Any, traffic: str, batch: int, prompt_len: int, seed: int,
                    sps: list[Any]) -> list[dict[str, Any]]:
    """The prompts of one timed run of ``traffic`` (``resend`` runs its first turn here)."""
    if traffic == "shared":
        return shared_prompts(batch, seed)
    if traffic == "resend":
        first = prompts(batch, TURN, seed)
        return second_turns(first, llm.generate(first, sps, use_tqdm=False), seed)
    return prompts(batch, prompt_len, seed)


class StepClock:
    """vLLM's own per-step timing of one engine: the engine core stamps every step's outputs
    (``EngineCoreOutputs.timestamp``, monotonic, taken in the core process when the step's
    tokens are out); the interval between two consecutive steps in which every request of
    the batch got a token is one decode step's wall time, host and GPU together.

    The median interval of a run is the decode figure: a run of 128 generated tokens gives
    ~127 intervals, so it is not moved by the prefill, admission or one slow step the way a
    run's tokens/s is (the method's noise, issue 12)."""

    def __init__(self, llm: Any) -> None:
        self._stamps: list[tuple[float, int]] = []
        self.intervals: list[float] = []
        """The last run's decode-step intervals (its tail tells host stalls from a slower
        GPU: a stall lengthens some steps, a slower kernel all of them)."""
        client = llm.llm_engine.engine_core
        get_output = client.get_output

        def _get_output() -> Any:
            outputs = get_output()
            self._stamps.append((outputs.timestamp, len(outputs.outputs)))
            return outputs

        client.get_output = _get_output

    def start(self) -> None:
        self._stamps.clear()

    def decode_step_s(self, batch: int) -> float:
        """Median wall time of the run's steps that gave every request a token."""
        pairs = zip(self._stamps, self._stamps[1:], strict=False)
        intervals = [t - t_prev for (t_prev, n_prev), (t, n) in pairs if n == n_prev == batch]
        self.intervals = intervals
        return statistics.median(intervals) if intervals else float("nan")

    def deciles(self) -> tuple[float, float]:
        """The 10th and 90th percentile of the last run's decode steps (seconds)."""
        if len(self.intervals) < 2:
            return float("nan"), float("nan")
        cuts = statistics.quantiles(self.intervals, n=10)
        return cuts[0], cuts[-1]


class SmClock:
    """The GPU's SM clock during a run (NVML through torch, sampled every 20 ms by a thread).

    At large batches an H100 decode step runs near the power limit, where the clock follows
    the power the data draws: two engines doing the same work on different values (a steered
    residual) can differ by percents in step time. The clock is reported beside the step so
    such a difference shows; cycles per step (step time x clock) over-corrects it, since the
    memory-bound part of a step does not scale with the SM clock."""

    def __init__(self) -> None:
        import threading

        self._samples: list[int] = []
        self._armed = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import torch

        while True:
            self._armed.wait()
            self._samples.append(torch.cuda.clock_rate())
            time.sleep(0.02)

    def start(self) -> None:
        self._samples.clear()
        self._armed.set()

    def stop_mhz(self) -> float:
        self._armed.clear()
        return statistics.fmean(self._samples) if self._samples else float("nan")


def traffic_shapes(traffic: list[str], batches: list[int], prefill: bool
                   ) -> tuple[list[tuple[str, int, int, int]], dict[str, str]]:
    """The shapes (name, batch, prompt tokens, generated tokens) of the runs, and each one's
    traffic; a ``resend`` shape's prompt is its timed second turn's."""
    shapes: list[tuple[str, int, int, int]] = []
    traffic_of: dict[str, str] = {}
    for kind_ in traffic:
        for b in batches:
            if kind_ == "fresh":
                shape = (f"{b}x{DECODE[0]}+{DECODE[1]}", b, *DECODE)
            elif kind_ == "shared":
                shape = (f"{b}x{SYSTEM_PROMPT}s+{TURN}+{DECODE[1]}", b, SYSTEM_PROMPT + TURN,
                         DECODE[1])
            else:
                shape = (f"{b}x2turn+{FOLLOW_UP}+{DECODE[1]}", b, 2 * TURN + FOLLOW_UP,
                         DECODE[1])
            shapes.append(shape)
            traffic_of[shape[0]] = kind_
    if prefill:
        shape = (f"32x{PREFILL[0]}+{PREFILL[1]}", 32, *PREFILL)
        shapes.append(shape)
        traffic_of[shape[0]] = "fresh"
    return shapes, traffic_of


def timed(llm: Any, clock: StepClock, sm: SmClock, batch_prompts: list[dict[str, Any]],
          sps: list[Any]) -> tuple[float, float, float]:
    """One run: (generated tokens/s over the whole run, median decode step in seconds, mean
    SM clock in MHz)."""
    clock.start()
    sm.start()
    t0 = time.perf_counter()
    outs = llm.generate(batch_prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    mhz = sm.stop_mhz()
    gen = sps[0].max_tokens
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    return len(batch_prompts) * gen / elapsed, clock.decode_step_s(len(batch_prompts)), mhz


def calibrate_gate(llm: Any, steering: Any) -> dict[str, Any]:
    """The bench probe with its threshold at the median score of real decode tokens, so the
    gate fires on about half of them (registered; returned to register it elsewhere)."""
    import numpy as np

    probe = np.random.default_rng(2).standard_normal(HIDDEN).astype(np.float32) / HIDDEN**0.5
    acts = steering.capture([p["prompt_token_ids"] for p in prompts(8, 64)],
                            [f"post_block@{MONITOR}"], reduce="all")[f"post_block@{MONITOR}"]
    scores = np.concatenate([a @ probe for a in acts])
    bench = {"weights": probe, "threshold": float(np.median(scores)),
             "sharpness": 8.0 / (scores.std() + 1e-6)}
    steering.register_probe("bench", **bench)
    return bench


class Subscriber:
    """A live subscriber of the events engine, counting what it receives (a thread)."""

    def __init__(self, address: str) -> None:
        import threading

        import zmq

        self.received = 0
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                self._socket.recv_multipart()
                self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._socket.close()


def add_host_time(total: dict[str, float], before: dict[str, Any],
                  after: dict[str, Any]) -> None:
    """Accumulate the worker's dynsteer host time of one run (see engine_ext/worker/host_time)
    and its steps by how the index was set (``fills_device``, ``fills_host``, ``fills_kept``),
    from two of its ``info()``."""
    for key, hook, field in (("step_us", "step", "us"), ("output_us", "output", "us"),
                             ("steps", "step", "calls"), ("admit_us", "admit", "us"),
                             ("admits", "admit", "calls")):
        total[key] = (total.get(key, 0.0) + after["host_time"][hook][field]
                      - before["host_time"][hook][field])
    for where, count in after["index_fills"].items():
        key = f"fills_{where}"
        total[key] = total.get(key, 0) + count - before["index_fills"].get(where, 0)


def summarize(run: dict[str, Any], key: str, host: dict[str, float] | None,
              base: str = "stock/idle") -> dict[str, Any]:
    """One scenario of one shape against ``base`` (stock) in the same run.

    ``ratio``: median tokens/s over stock's (whole runs, prefill included). ``step_ratio``:
    stock's median decode step over this one's (vLLM's per-step timing; > 1 is faster), and
    ``paired_step_ratio``: the median of the per-repetition ratios (each repetition's stock run
    and this run were minutes apart at most), with their range, the figure's own noise."""
    tok_s, stock_tok_s = run["samples"][key], run["samples"][base]
    step_s, stock_step_s = run["decode_step_s"][key], run["decode_step_s"][base]
    med = statistics.median(tok_s)
    paired = [s / x for s, x in zip(stock_step_s, step_s, strict=True)]
    mhz, stock_mhz = run["sm_mhz"][key], run["sm_mhz"][base]
    cycles = [s * m for s, m in zip(step_s, mhz, strict=True)]
    stock_cycles = [s * m for s, m in zip(stock_step_s, stock_mhz, strict=True)]
    per_step = per_request = None
    fills: dict[str, float] = {}
    if host:
        per_step = (host["step_us"] + host["output_us"]) / max(host["steps"], 1)
        per_request = host["admit_us"] / max(host["admits"], 1)
        fills = {k.removeprefix("fills_"): v for k, v in host.items() if k.startswith("fills_")}
    return {"tok_s": med, "ratio": med / statistics.median(stock_tok_s),
            "spread": (max(tok_s) - min(tok_s)) / med,
            "decode_step_ms": statistics.median(step_s) * 1e3,
            "step_ratio": statistics.median(stock_step_s) / statistics.median(step_s),
            "paired_step_ratio": statistics.median(paired),
            "paired_step_ratio_range": (min(paired), max(paired)),
            "sm_mhz": statistics.median(mhz),
            "cycle_ratio": statistics.median(stock_cycles) / statistics.median(cycles),
            "host_us_per_step": per_step, "host_us_per_request": per_request,
            "index_fills": fills}


def kind(engine: str, variant_is_plugin: bool = False) -> str:
    """What an engine instance is an instance of: ``plugin#2`` of ``plugin``; the A/A
    ``control`` of ``stock``; with ``variant_is_plugin`` (``--variant '{}'``), the variant of
    ``plugin``."""
    base = engine.split("#")[0]
    if base == "control":
        return "stock"
    return "plugin" if variant_is_plugin and base == "variant" else base


def engine_share(given: float | None, engines: int, tp: int,
                 shapes: list[tuple[str, int, int, int]], gpu_gib: float) -> float:
    """Each engine's ``gpu_memory_utilization``: ``given`` (``--mem``), else 0.9 shared by the
    ``engines``. Exits with the fix where that share cannot hold the weights and every
    sequence of the largest of ``shapes`` (name, batch, prompt, generated) on one of ``tp``
    GPUs: vLLM would fail at start after minutes of compiling, or preempt requests mid-run."""
    share = round(0.9 / engines, 3) if given is None else given
    tokens = max(batch * (prompt + generated) for _, batch, prompt, generated in shapes)
    need = memory_need_gib(LLAMA_8B, tokens) / tp
    if share * engines > 0.95 or share * gpu_gib < need:
        sys.exit(f"--mem {share}: {engines} engines of {share * gpu_gib:.1f} GiB each on this "
                 f"{gpu_gib:.0f} GiB GPU, where each needs {need:.1f} GiB for the weights and "
                 f"{tokens} tokens of KV cache (and all together at most 0.95 of the GPU). "
                 f"Start fewer engines (--instances, --control, --variant), run fewer "
                 f"tokens at once (--batches, --no-prefill), or use a larger GPU.")
    return share


def instance_plan(plan: list[tuple[str, dict[str, Any] | None]],
                  instances: int) -> list[tuple[str, dict[str, Any] | None]]:
    """``plan`` with its :data:`REPEATED` engines started ``instances`` times, every other
    round in reverse order (ABBA...), later rounds named ``name#2``...; the others (control,
    engines of their own) once, after the rounds."""
    rounds = [(n, o) for n, o in plan if n in REPEATED]
    out = list(rounds)
    for r in range(1, instances):
        out += [(f"{n}#{r + 1}", o) for n, o in (rounds[::-1] if r % 2 else rounds)]
    return out + [(n, o) for n, o in plan if n not in REPEATED]


def engine_runs(engines: list[str], scenarios: list[str]) -> list[tuple[str, str]]:
    """The (engine, scenario) runs of one repetition: stock instances run idle; plugin and
    variant instances every scenario but those with an engine of their own, which run there
    (on the projection-slot engine, with the plugin's too where no plugin engine runs)."""
    runs = []
    plugin = any(kind(e) == "plugin" for e in engines)
    for engine in engines:
        base = kind(engine)
        if base == "stock":
            runs.append((engine, "idle"))
        elif base in ("plugin", "variant"):
            runs += [(engine, s) for s in scenarios if s not in OWN_ENGINE]
        else:
            runs += [(engine, s) for s in scenarios if OWN_ENGINE.get(s) == base
                     or (base == "projecting" and not plugin and s not in OWN_ENGINE)]
    return runs


def pooled(run: dict[str, Any], base: list[str], keys: list[str]) -> dict[str, Any]:
    """Instances pooled: per repetition, the mean decode step of the ``base`` runs over the
    mean of the ``keys`` runs (> 1: ``keys`` faster), and the median and range over the
    repetitions."""
    steps = run["decode_step_s"]
    ratios = [statistics.mean(steps[b][i] for b in base)
              / statistics.mean(steps[k][i] for k in keys) for i in range(len(steps[base[0]]))]
    return {"paired_step_ratio": statistics.median(ratios),
            "paired_step_ratio_range": (min(ratios), max(ratios)), "base": base, "keys": keys}


def pooled_rows(run: dict[str, Any], variant_is_plugin: bool) -> dict[str, dict[str, Any]]:
    """The ``pooled`` rows of one shape: every scenario of plugin (and of a variant with other
    options) against stock, and such a variant against the plugin, where a side has more than
    one instance."""
    by_kind: dict[tuple[str, str], list[str]] = {}
    for key in run["decode_step_s"]:
        engine, scenario = key.split("/", 1)
        by_kind.setdefault((kind(engine, variant_is_plugin), scenario), []).append(key)
    stock = by_kind.get(("stock", "idle"), [])
    rows = {}
    for (name, scenario), keys in by_kind.items():
        if name in ("plugin", "variant") and max(len(stock), len(keys)) > 1:
            rows[f"{name}/{scenario}"] = pooled(run, stock, keys)
            plugin = by_kind.get(("plugin", scenario), [])
            if name == "variant" and max(len(plugin), len(keys)) > 1:
                rows[f"variant/{scenario} vs plugin"] = pooled(run, plugin, keys)
    return rows


def _fills(fills: dict[str, float]) -> str:
    """Steps whose index the device filled, the host filled, the device path kept."""
    if not fills:
        return "-"
    return "/".join(str(int(fills.get(k, 0))) for k in ("device", "host", "kept"))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@exits_on_sigterm
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-prefill", action="store_true", help="skip the 2048+16 shape")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS,
                    help="plugin scenarios to run beside stock (fewer: more reps in the time)")
    ap.add_argument("--traffic", nargs="+", choices=TRAFFIC, default=["fresh"],
                    help="fresh: new prompts every run; shared: a 1024-token system prompt "
                         "shared by every request; resend: a conversation's second turn "
                         "resending the first (at each of --batches)")
    ap.add_argument("--mem", type=float, default=None,
                    help="gpu_memory_utilization per engine (default: 0.9 shared by the "
                         "engines); refused before any engine starts where it cannot hold the "
                         "largest shape's every sequence")
    ap.add_argument("--control", action="store_true",
                    help="a second stock engine, started last, timed like the others: the "
                         "method's own bias and noise (an A/A ratio)")
    ap.add_argument("--variant", type=json.loads, default=None, metavar="JSON",
                    help="engine options of a third engine that runs the plugin scenarios "
                         "too, compared with the plugin's")
    ap.add_argument("--instances", type=int, default=1,
                    help="start stock, plugin (and variant) this many times each, in ABBA "
                         "order, and pool each side's instances (engines of one build differ "
                         "by up to 0.5%% at batch 1)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size of every engine (each spans that many GPUs)")
    ap.add_argument("--one-plugin-engine", action="store_true",
                    help="run the plugin scenarios on the projection-slot engine of ablate / "
                         "norm-match instead of an engine of their own (two engines: an 8B "
                         "model's stock and plugin engines fit one 80 GB GPU, three do not)")
    args = ap.parse_args()
    args.scenarios = list(dict.fromkeys(args.scenarios))
    import numpy as np
    import torch
    import vllm

    from dynsteer.engine_ext import Steering

    if "python" in args.scenarios:
        import bench_controllers

        bench_controllers.install()
    path = make_model()
    plan: list[tuple[str, dict[str, Any] | None]] = [("stock", None)]
    projecting = "ablate" in args.scenarios or "norm-match" in args.scenarios
    if set(args.scenarios) - set(OWN_ENGINE) and not (projecting and args.one_plugin_engine):
        plan.append(("plugin", {}))
    if args.variant is not None:
        plan.append(("variant", args.variant))
    if projecting:
        plan.append(("projecting", {"max_projections": 1}))
    if args.control:
        plan.append(("control", None))
    if "events" in args.scenarios:
        plan.append(("events", {"events_address": EVENTS_ADDRESS, "events_every": 1}))
    plan = instance_plan(plan, args.instances)
    shapes, traffic_of = traffic_shapes(args.traffic, args.batches, not args.no_prefill)
    mem = engine_share(args.mem, len(plan), args.tp, shapes,
                       torch.cuda.get_device_properties(0).total_memory / 2**30)
    t0 = time.time()
    engines = {name: start(path, dynsteer, mem, tp=args.tp) for name, dynsteer in plan}
    startup = time.time() - t0
    subscriber = Subscriber(EVENTS_ADDRESS) if "events" in engines else None
    steerings = {n: Steering(e) for n, e in engines.items()
                 if kind(n) in ("plugin", "variant", *OWN_ENGINE.values())}
    primary = next(n for n in ("plugin", "events", "projecting") if n in engines)
    steering = steerings[primary]
    vector = np.random.default_rng(0).standard_normal(HIDDEN).astype(np.float32) * 0.01
    steering.register_vector("bench", vector)
    steering.register_vector("null", vector * NULL_SCALE)
    bench = calibrate_gate(engines[primary], steering)
    specs = Specs(bench["threshold"])
    for name, other in steerings.items():
        if name != primary:
            other.register_vector("bench", vector)
            other.register_vector("null", vector * NULL_SCALE)
            other.register_probe("bench", **bench)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "vllm": vllm.__version__, "startup_s": startup,
                               "reps": args.reps, "tp": args.tp,
                               "runs": {}}
    runs = engine_runs(list(engines), args.scenarios)
    seed = 0
    clocks = {name: StepClock(llm) for name, llm in engines.items()}
    sm = SmClock()
    for shape, batch, prompt_len, gen_len in shapes:
        loads = {s: specs.params(s, batch, gen_len) for s in {"idle", *args.scenarios}}
        traffic = traffic_of[shape]
        for engine, scenario in runs:  # warm-up: first pass of each shape
            seed += 1
            timed(engines[engine], clocks[engine], sm,
                  traffic_prompts(engines[engine], traffic, batch, prompt_len, seed,
                                  loads[scenario]), loads[scenario])
        before = steering.info()[0]
        samples: dict[str, list[float]] = {f"{e}/{s}": [] for e, s in runs}
        steps: dict[str, list[float]] = {f"{e}/{s}": [] for e, s in runs}
        mhz: dict[str, list[float]] = {f"{e}/{s}": [] for e, s in runs}
        tails: dict[str, list[tuple[float, float]]] = {f"{e}/{s}": [] for e, s in runs}
        host: dict[str, dict[str, float]] = {}
        for rep in range(args.reps):
            for engine, scenario in runs if rep % 2 == 0 else runs[::-1]:
                seed += 1
                own = steerings.get(engine)
                start_info = own.info()[0] if own is not None else None
                tok_s, step_s, run_mhz = timed(
                    engines[engine], clocks[engine], sm,
                    traffic_prompts(engines[engine], traffic, batch, prompt_len, seed,
                                    loads[scenario]), loads[scenario])
                samples[f"{engine}/{scenario}"].append(tok_s)
                steps[f"{engine}/{scenario}"].append(step_s)
                mhz[f"{engine}/{scenario}"].append(run_mhz)
                tails[f"{engine}/{scenario}"].append(clocks[engine].deciles())
                if own is not None:
                    add_host_time(host.setdefault(f"{engine}/{scenario}", {}), start_info,
                                  own.info()[0])
        after = steering.info()[0]
        site = f"post_block@{MONITOR}"
        monitored = (after["tokens_monitored"].get(site, 0)
                     - before["tokens_monitored"].get(site, 0))
        gated = after["tokens_gated"].get(site, 0) - before["tokens_gated"].get(site, 0)
        results["runs"][shape] = {"samples": samples, "decode_step_s": steps, "sm_mhz": mhz,
                                  "decode_step_p10_p90_s": tails, "host_time": host,
                                  "gate_on_fraction": gated / max(monitored, 1)}
        args.out.mkdir(parents=True, exist_ok=True)  # what is done survives a time limit
        (args.out / "overhead.json").write_text(json.dumps(results, indent=2))
    if subscriber is not None:
        subscriber.close()
        results["events"] = {"received": subscriber.received,
                             **{k: v for k, v in steerings["events"].info()[0].items()
                                if k.startswith("events_")}}
    results["controllers"] = steering.info()[0]["controllers"]
    print(f"device: {results['device']}  vLLM {results['vllm']}  reps={args.reps}  "
          f"tp={args.tp}")
    print(f"{'shape':>14} {'scenario':<22} {'tok/s':>9} {'ratio':>7} {'spread':>7} "
          f"{'step ms':>8} {'step ratio':>10} {'paired':>15} {'SM MHz':>7} {'cycles':>7} "
          f"{'host us/step':>13} {'us/request':>11} {'fills dev/host/kept':>20}")
    summary = {}
    for shape, run in results["runs"].items():
        for key in run["samples"]:
            engine, scenario = key.split("/", 1)
            row = summarize(run, key, run["host_time"].get(key))
            if kind(engine) == "variant":
                row["vs_plugin"] = summarize(run, key, None, base=f"plugin/{scenario}")
            summary[f"{shape}/{key}"] = row
            low, high = row["paired_step_ratio_range"]
            print(f"{shape:>14} {key:<22} {row['tok_s']:>9.1f} {row['ratio']:>7.4f} "
                  f"{row['spread']:>7.2%} {row['decode_step_ms']:>8.3f} "
                  f"{row['step_ratio']:>10.4f} {low:>7.4f}-{high:<7.4f} "
                  f"{row['sm_mhz']:>7.0f} {row['cycle_ratio']:>7.4f} "
                  f"{_fmt(row['host_us_per_step']):>13} {_fmt(row['host_us_per_request']):>11} "
                  f"{_fills(row['index_fills']):>20}")
            if "vs_plugin" in row:
                vs = row["vs_plugin"]
                low, high = vs["paired_step_ratio_range"]
                print(f"{'':>14} {'  vs plugin/' + scenario:<22} {'':>9} {vs['ratio']:>7.4f} "
                      f"{'':>7} {'':>8} {vs['step_ratio']:>10.4f} {low:>7.4f}-{high:<7.4f} "
                      f"paired median {vs['paired_step_ratio']:.4f}")
        for name, row in pooled_rows(run, args.variant == {}).items():
            summary[f"{shape}/pooled/{name}"] = row
            low, high = row["paired_step_ratio_range"]
            print(f"{shape:>14} pooled {name:<26} {len(row['keys'])} instance(s) vs "
                  f"{len(row['base'])}: paired step ratio {row['paired_step_ratio']:.4f} "
                  f"({low:.4f}-{high:.4f})")
        print(f"{shape:>14} gate on for {run['gate_on_fraction']:.0%} of monitored tokens")
    if "events" in results:
        print(f"events: {results['events']}")
    results["summary"] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
