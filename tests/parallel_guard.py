"""The prefix guard under a parallel layout: a follow-up of a request whose gate, under a
controller, fired in decode hits exactly the blocks before the first position the gate steered,
so the report of the rank that computes the gate reaches the scheduler (a gate without a
controller is keyed and shares its blocks instead: ``test_prefix_cache.py``). Shared by
``test_tensor_parallel.py`` (CPU build) and ``gpu/test_gpu_parallel.py`` (GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GUARD_BLOCK = 32
"""The engines' KV block size (prefix caching on), for the prefix-guard check."""
GUARD_PROMPT = [1, *range(300, 369)]
"""70 tokens: two full blocks of prompt; decode tokens fill the third block and beyond."""
GUARD_DECODE = 40
MONITOR_SITES = "pre_attn@0,post_block@1,post_block@3"
"""The guard's gate reads ``pre_attn@0`` (the token embedding); the others' gates and the
capture read the default monitor sites of the 4-layer tiny model (one on each PP stage)."""


def gate_spec() -> dict[str, Any]:
    """The probe at layer 1 (the first PP stage) gating a vector at layers 1 and 3 (both)."""
    from tiny_models import vec

    return {"probe": {"weights": vec(1, norm=1.0), "threshold": 0.0, "sharpness": 50.0},
            "layer": 1, "steer": [{"vector": vec(31), "layers": [1, 3]}]}


def guard_run(llm: Any, steering: Any, model: str) -> dict[str, Any]:
    """The prefix guard under one layout (as ``tests/test_prefix_cache.py`` checks it on one
    rank). A gate whose probe is the embedding of a token the model first generates at decode
    position ``pos`` (read at ``pre_attn@0``), latched by the ``latch`` controller at its first
    firing, steers layers 1 and 3 from ``pos`` on; a follow-up whose prompt is that request's
    prompt + output, with the same spec, may hit only the blocks before the one holding
    ``pos``: the rank that computes the gate reports it to the scheduler."""
    import numpy as np
    from engine_utils import params, run
    from safetensors.numpy import load_file

    def one(tokens: list[int], spec: Any, max_tokens: int) -> Any:
        return run(llm, [tokens], [params(max_tokens, spec=spec, prompt_logprobs=None)])[0]

    plain = one(GUARD_PROMPT, None, GUARD_DECODE)
    tokens = GUARD_PROMPT + list(plain.outputs[0].token_ids)
    fresh = [t for t in range(len(GUARD_PROMPT), len(tokens) - 1)
             if tokens[t] not in tokens[:t]]
    pos = next((t for t in fresh if 2 * GUARD_BLOCK <= t < 3 * GUARD_BLOCK), fresh[0])
    embeds = load_file(str(Path(model) / "model.safetensors"))["model.embed_tokens.weight"]
    probe = embeds[tokens[pos]].astype(np.float64)
    norm2 = float(probe @ probe)
    spec = {"gate": {"probe": {"weights": probe.tolist(), "threshold": norm2 / 2,
                               "sharpness": 50.0 / norm2},
                     "layer": 0, "hook": "pre_attn", "trace": True,
                     "steer": gate_spec()["steer"]},
            "controller": {"name": "latch", "k": 1}}
    first = one(GUARD_PROMPT, spec, GUARD_DECODE)
    generated = list(first.outputs[0].token_ids)
    warm = one(GUARD_PROMPT + generated, spec, 4)
    return {"pos": pos, "generated": generated, "gates": steering.telemetry(first)["gates"],
            "warm_cached": warm.num_cached_tokens,
            "blocks_withheld": steering.cache_stats()["blocks_withheld"]}


def guard_checks(guard: dict[str, Any], one: dict[str, Any] | None) -> dict[str, bool]:
    """The gate first fired at ``pos`` and the follow-up hit exactly the blocks before it
    (and, beside a one-rank run, the same position, decode and hits as there)."""
    from dynsteer.engine_ext.prefix_guard.guard import DYNAMIC_EPSILON

    pos, gates = guard["pos"], guard["gates"]
    checks = {
        "prefix guard: gate first fires at the chosen position": gates[pos] > 0.5 and all(
            g is None or g < DYNAMIC_EPSILON for g in gates[:pos]),
        "prefix guard: follow-up hits only blocks before the first dynamic position":
            guard["warm_cached"] == pos // GUARD_BLOCK * GUARD_BLOCK,
        "prefix guard: blocks were withheld": guard["blocks_withheld"] > 0,
    }
    if one is not None:
        checks["prefix guard: same position, decode and hits as one rank"] = (
            (pos, guard["generated"], guard["warm_cached"])
            == (one["pos"], one["generated"], one["warm_cached"]))
    return checks
