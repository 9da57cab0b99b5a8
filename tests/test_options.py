"""Engine options and the site grammar (no engine)."""

from __future__ import annotations

import pytest

from dynsteer.controller.contract import resolve_sites
from dynsteer.engine_ext.options import EngineOptions, options_from_additional_config
from dynsteer.engine_ext.plugin import ENABLE_ENV


def test_disabled_without_key(monkeypatch):
    """No ``dynsteer`` key and no env var: the plugin stays off."""
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert options_from_additional_config({}) is None
    assert options_from_additional_config({"dynsteer": {"enabled": False}}) is None


def test_empty_dict_or_env_enables(monkeypatch):
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    assert options_from_additional_config({"dynsteer": {}}).max_rows == 64
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert options_from_additional_config({}).sites == "post_block@*"


def test_unknown_option_rejected():
    with pytest.raises(ValueError, match=r"additional_config.dynsteer.max_row"):
        options_from_additional_config({"dynsteer": {"max_row": 3}})


def test_default_sites_every_post_block():
    assert resolve_sites("post_block@*", 3) == (
        ("post_block", 0), ("post_block", 1), ("post_block", 2))


def test_sites_are_in_forward_order():
    """Sites sort by layer, then pre_attn < post_attn < post_block; duplicates collapse."""
    sites = resolve_sites(["post_block@1", "pre_attn@0-1", "post_attn@1+0", "pre_attn@1"], 4)
    assert sites == (("pre_attn", 0), ("post_attn", 0), ("pre_attn", 1), ("post_attn", 1),
                     ("post_block", 1))


@pytest.mark.parametrize(
    ("sites", "message"),
    [("post_block", "hook@layers"), ("mlp@1", "unknown hook 'mlp'"), ("pre_attn@3-1", "1 < 3"),
     ("pre_attn@x", "bad layer range"), ("post_block@0-9", "layer 9 .* does not exist"),
     ("post_block@101%", "use 0% to 100%"), ("post_block@x%", "bad layer depth")],
)
def test_bad_sites(sites, message):
    with pytest.raises(ValueError, match=message):
        resolve_sites(sites, 4)


def test_layers_by_depth():
    """``P%`` is the layer at P percent of the depth: 0% the first, 100% the last."""
    assert resolve_sites("post_block@0%+25%+50%+75%+100%", 30) == tuple(
        ("post_block", layer) for layer in (0, 7, 15, 22, 29))
    assert resolve_sites("pre_attn@50%", 1) == (("pre_attn", 0),)


def test_monitor_sites_default_and_join_the_sites():
    """By default probes read post_block at 1/4, 1/2 and 3/4 of the depth; monitor sites are
    steerable sites too, and ``""`` monitors nothing."""
    default = EngineOptions().engine_sites(32)
    assert default.monitor == {("post_block", 8), ("post_block", 16), ("post_block", 24)}
    assert default.all == resolve_sites("post_block@*", 32)
    joined = EngineOptions(sites="pre_attn@0", monitor_sites="post_attn@2").engine_sites(4)
    assert joined == ((("pre_attn", 0), ("post_attn", 2)), frozenset({("post_attn", 2)}))
    assert EngineOptions(monitor_sites="").engine_sites(4).monitor == frozenset()
    with pytest.raises(ValueError, match=r"^dynsteer.monitor_sites: layer 7 .* does not exist"):
        EngineOptions(monitor_sites="post_block@7").engine_sites(4)


def test_the_compile_cache_key_ignores_options_that_never_reach_the_graph():
    """vLLM's config hash names its compile cache: a new socket address, registry cap or
    norm limit keeps it (no recompile), a change of sites or rows does not."""
    from vllm.config import VllmConfig

    from dynsteer.engine_ext.plugin import register

    register()

    def key(**options) -> str:
        return VllmConfig(additional_config={"dynsteer": EngineOptions(
            **options).model_dump()}).compute_hash()

    base = key()
    assert key(commands_address="tcp://127.0.0.1:5601", events_address="tcp://127.0.0.1:5602",
               events_every=1, events_queue=8, max_vectors=3, max_probes=2,
               max_steer_norm=5.0) == base
    assert key(sites="post_block@0") != base
    assert key(max_rows=8) != base
    assert key(monitor_sites="") != base
    config = VllmConfig(additional_config={"dynsteer": {"commands_address": "tcp://x:1"}})
    config.compute_hash()
    assert config.additional_config == {"dynsteer": {"commands_address": "tcp://x:1"}}
