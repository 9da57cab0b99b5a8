"""A tiny random Llama (fp32) under torch.compile and FULL + PIECEWISE CUDA graphs against the HF
transformers hook reference: a plain engine first, then the plugin engine on the same path (the
compile-cache trap); static steering at every hook and phase, gated steering (same-site and
cross-layer, inline and registered probes) with its telemetry, activation capture at the monitor
sites, every built-in controller and a Python one (through its entry point) against the
step-by-step reference of ``test_controllers_engine.py``, global steering set then cleared,
overflowing rows written straight into the workers (bypassing validation), and the graphs:
replayed, none captured after startup, the index filled on the device.

``VLLM_USE_V2_MODEL_RUNNER=0`` runs the same on vLLM's V1 runner (its graphs are not counted).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from engine_checks import (
    ENGINE_OPTIONS,
    GPU,
    PROMPTS,
    assert_gating,
    assert_global,
    assert_graphs,
    assert_static,
    gating_check,
    global_check,
    hf_bound,
    static_check,
)
from replays import replays

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def plain_tokens(tiny_model_dir) -> list[list[int]]:
    """The plain engine's greedy tokens of :data:`PROMPTS` (started before the plugin's)."""
    from engine_utils import params, run, start_llm, stop_llm

    plain = start_llm(tiny_model_dir("llama"), **GPU)
    try:
        outs = run(plain, PROMPTS, [params(max_tokens=12) for _ in PROMPTS])
    finally:
        stop_llm(plain)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def sink_dir(tmp_path_factory) -> Any:
    return tmp_path_factory.mktemp("gpu-sink")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, plain_tokens, controller_plugins, sink_dir) -> Any:
    """The plugin engine (every hook at every layer, the gating cases' monitor sites, a
    capture sink), its ``Steering``, and its graph counts at startup."""
    from engine_utils import start_llm, stop_llm
    from test_gating_reference import MONITOR_SITES

    from dynsteer.engine_ext import Steering

    llm = start_llm(tiny_model_dir("llama"),
                    dynsteer={**ENGINE_OPTIONS, "monitor_sites": MONITOR_SITES,
                              "capture_sinks": {"disk": f"{sink_dir}?shard_bytes=262144"}},
                    **GPU)
    try:
        yield SimpleNamespace(llm=llm, steering=Steering(llm), before=replays(llm))
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def static(engine, hf_llama) -> tuple[dict[str, dict[str, float]], Any]:
    return static_check(engine.llm, hf_llama)


def test_static_steering_matches_hf_at_every_hook_and_phase(static) -> None:
    assert_static(static[0])


def test_the_unsteered_baseline_equals_the_plain_engine(static, plain_tokens) -> None:
    """The plugin engine, started on the plain engine's model path after it, gives the plain
    engine's tokens unsteered (and steers, above)."""
    _, baseline = static
    assert list(baseline.outputs[0].token_ids) == plain_tokens[0]


def test_gated_steering_and_its_telemetry_match_hf(engine, hf_llama, static) -> None:
    assert_gating(gating_check(engine.llm, hf_llama, engine.steering), hf_bound(static[0]))


@pytest.mark.parametrize("reduce", ["last", "mean", "all"])
def test_capture_matches_hf_streams(engine, hf_llama, reduce: str) -> None:
    """``Steering.capture`` at the monitor sites (a pass of the default 4 lanes) against HF's
    streams; its rows are free after. Captures beside steered traffic are checked on the CPU
    build (``test_capture.py``, AsyncLLM)."""
    from hf_reference import record_streams
    from test_capture import PROMPTS as CAPTURED
    from test_gating_reference import MONITOR_SITES

    streams = [record_streams(hf_llama, p) for p in CAPTURED]
    result = engine.steering.capture(CAPTURED, MONITOR_SITES, reduce=reduce)
    err = 0.0
    for site, got in result.items():
        hook, layer = site.split("@")
        want = [s[(hook, int(layer))] for s in streams]
        if reduce == "all":
            err = max(err, *(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)))
        else:
            red = np.stack([w[-1] if reduce == "last" else w.mean(0) for w in want])
            err = max(err, float(np.abs(got - red).max()))
    assert err <= 2e-3
    assert not any(i["capture_rows_in_use"] for i in engine.steering.info())


def test_an_engine_sink_holds_hf_streams(engine, hf_llama, sink_dir) -> None:
    """Requests whose capture names the engine's sink, under steering and CUDA graphs, long
    enough that the worker writes stretches while they run: read back, every site's rows
    equal HF's streams over the same tokens."""
    from engine_utils import params, run
    from hf_reference import record_streams
    from test_gating_reference import MONITOR_SITES

    from dynsteer import capture

    spec = {"steer": [{"vector": [0.05] * hf_llama.config.hidden_size, "layers": [0]}],
            "capture": {"sites": MONITOR_SITES, "sink": "disk"}}
    outs = run(engine.llm, PROMPTS, [params(max_tokens=70, spec=spec) for _ in PROMPTS])
    totals = engine.steering.flush_capture_sinks()["disk"]
    assert totals["dropped"] == 0
    store = {r.request_id: r for r in capture.open(sink_dir)}
    err = 0.0
    for out in outs:
        got = store[out.request_id]
        tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids][:-1]
        assert got.activations.positions.tolist() == list(range(len(tokens)))
        streams = record_streams(hf_llama, tokens, spec["steer"])
        for site in MONITOR_SITES.split(","):
            hook, layer = site.split("@")
            err = max(err, float(np.abs(got[site] - streams[(hook, int(layer))]).max()))
    assert err <= 2e-3
    assert not any(i["capture_rows_in_use"] for i in engine.steering.info())


def test_controllers_match_the_step_by_step_reference(engine, hf_llama) -> None:
    """The built-in controllers and a Python one (``pylatch``, loaded through its entry point)
    under graphs: logprobs against HF steered with the reference's decisions, gates against
    the reference, and each controller acted without an error."""
    from engine_utils import logprobs_of, params, run
    from hf_reference import run_reference
    from test_controllers_engine import MAX_TOKENS, PROMPT, base_gate, cases, decisions

    gate, scores = base_gate(hf_llama)
    specs = {k: v for k, v in cases(scores, gate).items()
             if k in ("latch", "latch-threshold", "hysteresis", "proportional", "budget")}
    specs["python"] = {"name": "pylatch", "k": 4}
    outs = run(engine.llm, [PROMPT] * len(specs),
               [params(MAX_TOKENS, spec={"gate": gate, "controller": s})
                for s in specs.values()])
    failed = {}
    for (name, spec), out in zip(specs.items(), outs, strict=True):
        tokens, got = logprobs_of(out)
        want, steerer = run_reference(hf_llama, tokens, len(PROMPT), gate=gate,
                                      gate_fn=decisions(spec, len(PROMPT)))
        tele = engine.steering.telemetry(out)
        processed = len(tokens) - 1
        gates = np.array(tele["gates"][:processed], dtype=np.float64)
        row = {"max_abs_err_vs_hf": float(np.abs(got - want).max()),
               "max_gate_err_vs_reference": float(np.abs(
                   gates - steerer.gates.numpy()[:processed]).max()),
               "events": len(tele["controller"]["events"]), "error": tele["controller"]["error"]}
        if not (row["max_abs_err_vs_hf"] <= 2e-3 and row["max_gate_err_vs_reference"] <= 5e-3
                and row["events"] > 0 and row["error"] is None):
            failed[name] = row
    assert not failed, failed


def test_global_steering_changes_outputs_and_clears_to_the_baseline(engine) -> None:
    assert_global(global_check(engine.llm, engine.steering))


def test_overflowing_rows_written_into_the_workers_change_nothing(engine) -> None:
    """Rows of 1e30 written with the raw worker RPC (bypassing validation): those requests and
    the ones after them equal the baseline; the same spec through the front door is refused."""
    from engine_utils import logprobs_of, params, raw_set_global, run

    from dynsteer.controller.spec import parse_entries
    from dynsteer.controller.wire import entry_to_wire

    llm = engine.llm

    def same(outs: list[Any], ref: list[Any]) -> bool:
        return all(list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                   and float(np.abs(logprobs_of(a)[1] - logprobs_of(b)[1]).max()) < 1e-4
                   for a, b in zip(outs, ref, strict=True))

    def plain() -> list[Any]:
        return run(llm, PROMPTS, [params(max_tokens=12) for _ in PROMPTS])

    base = plain()
    poisons = {"inf_row": [{"vector": [1e30] * 128, "layers": [1, 2], "scale": 1e30}],
               "huge_finite_row": [{"vector": [1e30] * 128, "layers": [1]}]}
    try:
        for name, entries in poisons.items():
            raw_set_global(llm, [entry_to_wire(e) for e in parse_entries(entries)])
            assert same(plain(), base), name
    finally:
        raw_set_global(llm, [])
    assert same(plain(), base)
    with pytest.raises(ValueError, match="max_steer_norm"):
        run(llm, PROMPTS[:1], [params(spec={"steer": [
            {"vector": [1e20] * 128, "layers": [1], "scale": 1e20}]})])


def test_full_graphs_replayed_and_none_captured_after_startup(engine) -> None:
    """Over this module's traffic (and a static batch of its own, for ``-k``): FULL graphs
    replayed, none captured after startup, the index filled on the device and kept on decode
    steps of an ungated batch (V2 runner)."""
    from engine_utils import params, run
    from tiny_models import STATIC_CASES

    spec = {"steer": STATIC_CASES["post_block-all"]}
    run(engine.llm, PROMPTS, [params(max_tokens=12, spec=spec) for _ in PROMPTS])
    assert_graphs(engine.before, replays(engine.llm))
