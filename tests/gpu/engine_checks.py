"""What the GPU engine tests run on an engine and compare with HF (``test_gpu_engine.py``,
``test_gpu_architectures.py``): the CPU tests' cases, under CUDA graphs.

Logprobs must match HF within 2e-3, or within twice the unsteered baseline's own difference
from HF where that is larger (:func:`hf_bound`): a model whose plain fp32 forward on the GPU
already differs from HF's by 2e-3 (the tiny Gemma 3 on an H100) cannot be held to a tighter
bound when steered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [1, 300, 5, 77, 8]]
ENGINE_OPTIONS = {"sites": "pre_attn@*,post_attn@*,post_block@*"}
"""Every hook at every layer; the engines add the gating cases' monitor sites, so every other
site steers through the fused add under graphs."""
GPU = {"gpu_memory_utilization": 0.3}


def static_check(llm: Any, hf: Any) -> tuple[dict[str, dict[str, float]], Any]:
    """The static cases of ``tiny_models.STATIC_CASES`` (every hook and phase) against HF:
    per case the largest logprob error and the steering's own effect; and the unsteered
    baseline's request output."""
    from engine_utils import logprobs_of, params, run
    from hf_reference import reference_logprobs
    from tiny_models import STATIC_CASES

    names = ["baseline", *STATIC_CASES]
    sps = [params(max_tokens=12, spec=None if n == "baseline" else {"steer": STATIC_CASES[n]})
           for n in names]
    outs = run(llm, [PROMPTS[i % 2] for i in range(len(names))], sps)
    errors = {}
    for name, out in zip(names, outs, strict=True):
        tokens, got = logprobs_of(out)
        entries = [] if name == "baseline" else STATIC_CASES[name]
        want = reference_logprobs(hf, tokens, len(out.prompt_token_ids), entries)
        unsteered = reference_logprobs(hf, tokens, len(out.prompt_token_ids))
        errors[name] = {"max_abs_err_vs_hf": float(np.abs(got - want).max()),
                        "steering_effect": float(np.abs(want - unsteered).max())}
    return errors, outs[0]


def hf_bound(static: dict[str, dict[str, float]]) -> float:
    """The logprob bound against HF (module docstring)."""
    return max(2e-3, 2 * static["baseline"]["max_abs_err_vs_hf"])


def gating_check(llm: Any, hf: Any, steering: Any) -> dict[str, dict[str, Any]]:
    """The gating cases of ``test_gating_reference.py`` (same-site and cross-layer, inline and
    registered probes, each phase): per case the logprob and gate errors against HF and
    whether the gated counters equal HF's."""
    from engine_utils import logprobs_of, params, run
    from hf_reference import run_reference
    from test_gating_reference import PROMPT, REGISTERED, base_cases, calibrate, register_probes

    register_probes(steering)
    cases = {name: calibrate(hf, spec) for name, spec in base_cases().items()}
    outs = run(llm, [PROMPT] * len(cases), [params(8, spec=s) for s in cases.values()])
    report = {}
    for (name, spec), out in zip(cases.items(), outs, strict=True):
        tokens, got = logprobs_of(out)
        want, steerer = run_reference(hf, tokens, len(PROMPT), spec.get("steer", []),
                                      gate=spec["gate"], probes=REGISTERED)
        ungated = run_reference(hf, tokens, len(PROMPT), spec.get("steer", []))[0]
        tele = steering.telemetry(out)
        processed = len(tokens) - 1
        want_gates = steerer.gates.numpy()[:processed]
        # Cases without "trace" have counters only: check those against HF's gates instead.
        gates = (np.array(tele["gates"][:processed], dtype=np.float64) if tele["gates"]
                 else want_gates)
        report[name] = {
            "max_abs_err_vs_hf": float(np.abs(got - want).max()),
            "max_gate_err_vs_hf": float(np.abs(gates - want_gates).max()),
            "gate_effect": float(np.abs(want - ungated).max()),
            "gated_counts_equal_hf": tele["gated_prefill"] + tele["gated_decode"]
            == int((want_gates > 0.5).sum()),
        }
    return report


def global_check(llm: Any, steering: Any) -> dict[str, list[Any]]:
    """Global steering set then cleared: how much it changed every request, and whether the
    cleared outputs are the baseline's again (a baseline re-run is the determinism
    yardstick)."""
    from engine_utils import logprobs_of, params, run
    from tiny_models import STATIC_CASES

    def diff(a: Any, b: Any) -> float:
        return float(np.abs(logprobs_of(a)[1] - logprobs_of(b)[1]).max())

    sps = [params(max_tokens=12) for _ in PROMPTS]
    base = run(llm, PROMPTS, sps)
    base2 = run(llm, PROMPTS, sps)
    steering.set_global([{"vector": STATIC_CASES["post_block-all"][0]["vector"],
                          "layers": [1, 2]}])
    steered = run(llm, PROMPTS, sps)
    steering.clear_global()
    after = run(llm, PROMPTS, sps)
    return {
        "changed": [diff(s, b) for s, b in zip(steered, base, strict=True)],
        "cleared_tokens_equal_baseline": [
            list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            for a, b in zip(after, base, strict=True)],
        "cleared_max_abs_logprob_diff": [diff(a, b) for a, b in zip(after, base, strict=True)],
        "baseline_rerun_max_abs_logprob_diff": [
            diff(a, b) for a, b in zip(base2, base, strict=True)],
    }


def assert_static(static: dict[str, dict[str, float]]) -> None:
    bound = hf_bound(static)
    failed = {n: e for n, e in static.items() if not e["max_abs_err_vs_hf"] <= bound}
    assert not failed, (bound, failed)


def assert_gating(gating: dict[str, dict[str, Any]], bound: float) -> None:
    """Each gating case within ``bound`` of HF, widened by what its gate error can move: a
    gate off by ``d`` scales the gated steering's effect (``gate_effect``, the logprob change
    the gate makes in HF) by ``d``, so a steep gate's last-digit difference from HF near the
    threshold shows in the logprobs as ``d * gate_effect``; the gate error itself stays within
    5e-3 and the gated token counts equal HF's."""
    failed = {n: e for n, e in gating.items()
              if not (e["max_abs_err_vs_hf"] <= bound + e["max_gate_err_vs_hf"] * e["gate_effect"]
                      and e["max_gate_err_vs_hf"] <= 5e-3 and e["gated_counts_equal_hf"])}
    assert not failed, (bound, failed)


def assert_global(result: dict[str, list[Any]]) -> None:
    assert min(result["changed"]) > 1e-2, result
    assert all(result["cleared_tokens_equal_baseline"]), result


def assert_graphs(before: dict[str, Any], after: dict[str, Any]) -> None:
    """FULL graphs replayed, none captured after ``before``; the V2 runner filled the index on
    the device and kept it on decode steps of an ungated batch. Nothing to check under the
    V1 runner (``replays.count_replays`` has no replays there)."""
    import pytest

    if "replays" not in after:
        pytest.skip(f"runner {after['runner']}: its graphs are not counted")
    assert after["replays"] > before["replays"], (before, after)
    assert after["graphs"] == before["graphs"], (before, after)
    fills, fills_before = after["index_fills"], before["index_fills"]
    assert fills.get("device", 0) > fills_before.get("device", 0), (before, after)
    assert fills.get("kept", 0) > fills_before.get("kept", 0), (before, after)
