"""``benchmarks/overhead.py``'s bookkeeping, without a GPU: the engines ``--instances`` starts and
the runs each makes, the ``pooled`` rows over instances, and the memory share that refuses a
run before any engine starts."""

from __future__ import annotations

import pytest
from overhead import engine_runs, engine_share, instance_plan, pooled_rows


def test_instances_start_abba_and_run_every_instance():
    """``--instances``: stock, plugin and variant once per round, every other round reversed;
    control and engines of their own once, after the rounds; each instance runs its kind's
    scenarios."""
    plan = [("stock", None), ("plugin", {}), ("projecting", {"max_projections": 1}),
            ("control", None)]
    names = [n for n, _ in instance_plan(plan, 3)]
    assert names == ["stock", "plugin", "plugin#2", "stock#2", "stock#3", "plugin#3",
                     "projecting", "control"]
    assert instance_plan(plan, 1) == [plan[0], plan[1], plan[2], plan[3]]
    runs = engine_runs([*names[:4], "projecting", "control"], ["idle", "gated", "ablate"])
    assert runs == [("stock", "idle"), ("plugin", "idle"), ("plugin", "gated"),
                    ("plugin#2", "idle"), ("plugin#2", "gated"), ("stock#2", "idle"),
                    ("projecting", "ablate"), ("control", "idle")]


def test_without_a_plugin_engine_the_projection_slot_engine_runs_the_plugin_scenarios():
    """``--one-plugin-engine``: registered and positions run beside norm-match on the one
    engine with a projection slot, so they are compared in the same run on two engines."""
    runs = engine_runs(["stock", "projecting"], ["registered", "positions", "norm-match"])
    assert runs == [("stock", "idle"), ("projecting", "registered"),
                    ("projecting", "positions"), ("projecting", "norm-match")]


def test_pooled_rows_average_the_instances_of_each_side():
    """Per repetition, mean stock step / mean plugin step; a variant with other options is also
    pooled against the plugin; with ``--variant '{}'`` it is a plugin instance, and the control
    a stock one. No row where each side has one instance."""
    steps = {"stock/idle": [1.0, 1.0], "plugin/idle": [1.01, 1.01], "variant/idle": [0.99, 1.03],
             "control/idle": [0.98, 1.02]}
    rows = pooled_rows({"decode_step_s": steps}, variant_is_plugin=True)
    assert list(rows) == ["plugin/idle"]
    assert rows["plugin/idle"]["paired_step_ratio_range"] == (0.99 / 1.0, 1.01 / 1.02)
    assert rows["plugin/idle"]["base"] == ["stock/idle", "control/idle"]
    other = pooled_rows({"decode_step_s": steps}, variant_is_plugin=False)
    assert sorted(other) == ["plugin/idle", "variant/idle"]  # plugin: 1 vs 2 stock instances
    assert other["variant/idle"]["keys"] == ["variant/idle"]
    del steps["control/idle"]
    steps["variant#2/idle"] = [1.0, 1.0]
    rows = pooled_rows({"decode_step_s": steps}, variant_is_plugin=False)
    assert sorted(rows) == ["variant/idle", "variant/idle vs plugin"]
    assert rows["variant/idle vs plugin"]["base"] == ["plugin/idle"]
    assert pooled_rows({"decode_step_s": {"stock/idle": [1.0], "plugin/idle": [1.0]}},
                       variant_is_plugin=False) == {}


def test_engine_share_fits_the_engines_or_says_what_to_change():
    """``--mem``: by default 0.9 shared by the engines; a share that cannot hold the 8B shape's
    weights and every sequence of the largest shape exits before any engine starts (``--mem
    0.15`` on an H100 once failed only after the first engine had compiled)."""
    decode_32 = [("32x128+128", 32, 128, 128)]
    decode_256 = [("256x128+128", 256, 128, 128)]
    assert engine_share(None, 2, 1, decode_32, 79.2) == 0.45
    assert engine_share(0.3, 2, 1, decode_32, 79.2) == 0.3
    assert engine_share(None, 4, 1, decode_256, 139.8) == 0.225  # two instances a side, H200
    with pytest.raises(SystemExit, match=r"--mem 0.15: 2 engines of 11.9 GiB .* needs 19.0 GiB"):
        engine_share(0.15, 2, 1, decode_32, 79.2)
    with pytest.raises(SystemExit, match="--instances"):
        engine_share(None, 4, 1, decode_256, 79.2)  # 19.8 GiB each, 26 needed
    assert engine_share(None, 4, 2, decode_256, 79.2) == 0.225  # TP 2 halves each GPU's share
    with pytest.raises(SystemExit, match=r"at most 0\.95"):
        engine_share(0.5, 2, 1, decode_32, 139.8)


def test_traffic_shapes_and_their_prompts():
    """``shared``: one system prompt for every request and run of a batch size, a new turn
    each run; ``resend``: the timed turn resends the first turn's prompt and output."""
    from types import SimpleNamespace

    from overhead import (
        FOLLOW_UP,
        SYSTEM_PROMPT,
        TURN,
        second_turns,
        shared_prompts,
        traffic_shapes,
    )

    shapes, traffic = traffic_shapes(["fresh", "shared", "resend"], [32], prefill=False)
    assert [traffic[name] for name, *_ in shapes] == ["fresh", "shared", "resend"]
    assert [prompt for _, _, prompt, _ in shapes] == [128, SYSTEM_PROMPT + TURN,
                                                      2 * TURN + FOLLOW_UP]
    a, b = shared_prompts(4, seed=1), shared_prompts(4, seed=2)
    heads = {tuple(p["prompt_token_ids"][:SYSTEM_PROMPT]) for p in a + b}
    assert len(heads) == 1 and a[0]["prompt_token_ids"] != b[0]["prompt_token_ids"]
    first = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6]}]
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8])])] * 2
    turns = second_turns(first, outs, seed=3)
    assert [t["prompt_token_ids"][:5] for t in turns] == [[1, 2, 3, 7, 8], [4, 5, 6, 7, 8]]
    assert all(len(t["prompt_token_ids"]) == 5 + FOLLOW_UP for t in turns)


def test_dict_scenarios_hand_each_request_a_dict_of_its_own():
    from overhead import DICT_DISTINCT, Specs

    specs = Specs(threshold=0.0)
    params = specs.params("dict-16", 20, 4)
    first, again = params[0].extra_args["dynsteer"], params[DICT_DISTINCT].extra_args["dynsteer"]
    assert isinstance(first, dict) and first == again and first is not again
    assert isinstance(first["steer"][0]["vector"], list)
    assert isinstance(specs.params("inline-32", 2, 4)[0].extra_args["dynsteer"], str)
