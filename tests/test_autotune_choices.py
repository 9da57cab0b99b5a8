"""``benchmarks/autotune_choices.py``: which engine's start wrote which autotune choice, and
where engines tuned the same kernel differently; and ``overhead.py --autotune own``'s key, which
must give an engine a compile cache of its own without changing what the plugin sees."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from autotune_choices import EngineChoices, describe, disagreements

PERSISTENT_KERNEL = '''
@triton_heuristics.reduction(size_hints={'x': 8192, 'r0_': 4096},
    inductor_meta={'kernel_name': 'triton_red_fused_add_rms_norm_3', 'add_persistent_rblock': True})
@triton.jit
def triton_red_fused_add_rms_norm_3(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
'''
PLAIN_KERNEL = '''
@triton_heuristics.reduction(inductor_meta={'kernel_name': 'triton_red_fused_mean_1'})
@triton.jit
def triton_red_fused_mean_1(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
'''


def _kernel(root: Path, folder: str, name: str, source: str, best: dict | None) -> Path:
    """A kernel file as Inductor writes it, with its autotuner's choice beside it."""
    directory = root / "inductor_cache" / folder
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"c{name}.py").write_text(source)
    path = directory / f"{name}.best_config"
    if best is not None:
        path.write_text(json.dumps({**best, "configs_hash": "h", "found_by_coordesc": False,
                                    "time_taken_ms": 7, "triton_cache_hash": "t"}))
    return path


def test_describe_reads_the_launch_config_and_the_kernels_beside_it(tmp_path):
    path = _kernel(tmp_path, "ab", "abc1", PERSISTENT_KERNEL,
                   {"XBLOCK": 1, "R0_BLOCK": 4096, "num_warps": 16, "num_stages": 1})
    broken = tmp_path / "inductor_cache" / "ab" / "bad.best_config"
    broken.write_text("{not json")
    described = describe({path, broken})
    assert described["ab/abc1.best_config"] == {
        "path": str(path),
        "config": {"XBLOCK": 1, "R0_BLOCK": 4096, "num_warps": 16, "num_stages": 1},
        "time_taken_ms": 7,
        "kernels_beside": {"triton_red_fused_add_rms_norm_3": True}}
    assert "error" in described["ab/bad.best_config"]


def test_disagreements_name_only_kernels_tuned_differently():
    persistent = {"config": {"R0_BLOCK": 4096, "num_warps": 16}}
    looped = {"config": {"R0_BLOCK": 2048, "num_warps": 16}}
    by_engine = {"stock": {"ab/k1.best_config": looped, "cd/k2.best_config": looped},
                 "plugin": {"ab/k1.best_config": persistent, "cd/k2.best_config": looped,
                            "ef/k3.best_config": persistent},
                 "variant": {"ab/k1.best_config": persistent, "x/bad.best_config": {"error": "e"}}}
    assert disagreements(by_engine) == {"ab/k1.best_config": {
        "stock": looped["config"], "plugin": persistent["config"],
        "variant": persistent["config"]}}
    assert disagreements({"stock": by_engine["stock"]}) == {}


def test_engine_choices_attribute_each_start_its_new_files(tmp_path, monkeypatch):
    """Files present before the first start belong to no engine; each start owns what
    appeared since the one before it, in the folders the benchmark passes as well."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _kernel(tmp_path / "vllm", "00", "old", PLAIN_KERNEL, {"XBLOCK": 1, "R0_BLOCK": 1024})
    choices = EngineChoices([tmp_path / "own"])
    _kernel(tmp_path / "vllm" / "hash1", "ab", "k1", PERSISTENT_KERNEL,
            {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16})
    _kernel(tmp_path / "vllm" / "hash1", "cd", "k2", PLAIN_KERNEL, None)  # tuned nothing
    choices.started("stock")
    _kernel(tmp_path / "own" / "plugin", "ab", "k1", PERSISTENT_KERNEL,
            {"XBLOCK": 1, "R0_BLOCK": 4096, "num_warps": 16})
    choices.started("plugin")
    choices.started("control")  # loaded everything from a shared cache: wrote nothing
    assert list(choices.by_engine["stock"]) == ["ab/k1.best_config"]
    assert list(choices.by_engine["plugin"]) == ["ab/k1.best_config"]
    assert choices.by_engine["control"] == {}
    report = choices.report()
    assert report["disagreements"] == {"ab/k1.best_config": {
        "stock": {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16},
        "plugin": {"XBLOCK": 1, "R0_BLOCK": 4096, "num_warps": 16}}}
    assert str(tmp_path / "own") in report["roots"]
    lines = choices.summary_lines()
    assert lines[0] == ("autotune stock: 1 choices written; persistent-capable kernels "
                        "(R0_BLOCK chosen): triton_red_fused_add_rms_norm_3=2048")
    assert lines[2].startswith("autotune control: 0 choices written")
    assert lines[-1].startswith("autotune disagreement ab/k1.best_config")


def test_own_compile_key_gives_an_engine_its_own_compile_cache_and_nothing_else():
    """The benchmark's instance key changes vLLM's compile-cache key (so an A/A engine
    compiles and autotunes for itself), leaves a stock engine stock, and leaves the plugin's
    options as they were."""
    from overhead import INSTANCE_KEY
    from vllm.config import VllmConfig

    from dynsteer.engine_ext.options import options_from_additional_config
    from dynsteer.engine_ext.plugin import register, requested

    register()
    plugin = {"dynsteer": {"max_rows": 8}}
    own = {**plugin, INSTANCE_KEY: "variant"}
    assert (VllmConfig(additional_config=own).compute_hash()
            != VllmConfig(additional_config=plugin).compute_hash())
    assert options_from_additional_config(own) == options_from_additional_config(plugin)
    assert not requested({INSTANCE_KEY: "control"})
    assert (VllmConfig(additional_config={INSTANCE_KEY: "control"}).compute_hash()
            != VllmConfig().compute_hash())


SITE_KERNEL_SOURCE = PERSISTENT_KERNEL.replace("add_rms_norm_3", "add_rms_norm_steer_0")


def test_flip_rblock_rewrites_only_site_kernels_that_offered_both_configs(tmp_path):
    """``overhead.py --flip-site-rblock``: a site kernel's choice becomes the other of its two
    configs, in the file a later engine reads, bookkeeping kept; kernels without the name, or
    that offered one config, are left alone."""
    from autotune_choices import flip_rblock

    site = _kernel(tmp_path, "ab", "site", SITE_KERNEL_SOURCE,
                   {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16})
    plain = _kernel(tmp_path, "cd", "norm", PERSISTENT_KERNEL,
                    {"XBLOCK": 1, "R0_BLOCK": 4096, "num_warps": 16})
    single = _kernel(tmp_path, "ef", "one", PLAIN_KERNEL.replace("mean_1", "steer_1"),
                     {"XBLOCK": 1, "R0_BLOCK": 2048})
    before = {p: p.read_text() for p in (plain, single)}
    files = describe({site, plain, single})
    assert flip_rblock(files, "steer", 4096) == {"ab/site.best_config": [2048, 4096]}
    flipped = json.loads(site.read_text())
    assert flipped["R0_BLOCK"] == 4096 and flipped["configs_hash"] == "h"
    assert {p: p.read_text() for p in (plain, single)} == before
    assert flip_rblock(describe({site}), "steer", 4096) == {"ab/site.best_config": [4096, 2048]}


def test_instances_start_abba_and_run_every_instance():
    """``overhead.py --instances``: stock, plugin and variant once per round, every other round
    reversed; control and engines of their own once, after the rounds; each instance runs its
    kind's scenarios."""
    from overhead import engine_runs, instance_plan

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


def test_pooled_rows_average_the_instances_of_each_side():
    """Per repetition, mean stock step / mean plugin step; a variant with other options is also
    pooled against the plugin; with ``--variant '{}'`` it is a plugin instance, and the control
    a stock one. No row where each side has one instance."""
    from overhead import pooled_rows

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
    """``overhead.py --mem``: by default 0.9 shared by the engines; a share that cannot hold the
    8B shape's weights and every sequence of the largest shape exits before any engine starts
    (session 35: ``--mem 0.15`` on an H100 failed only after the first engine had compiled)."""
    import pytest
    from overhead import engine_share

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
