"""Engine options (``additional_config={"dynsteer": {...}}``) and the site grammar.

A *site* is one (hook, layer) pair that gets a fused steering kernel. The set of sites is fixed
when the engine starts because it is baked into the compiled graph: layers without a site pay
nothing. Sites are written ``hook@layers``: ``post_block@*``, ``pre_attn@0-3``, ``post_attn@5``;
several are separated by commas or given as a list.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dynsteer.controller.limits import DEFAULT_MAX_STEER_NORM
from dynsteer.controller.spec import HOOKS, Hook, site_key

CONFIG_KEY = "dynsteer"
"""Key in vLLM's ``additional_config``."""
ENABLE_ENV = "DYNSTEER_ENABLE"
"""Set to 1 to enable the plugin with default options when ``additional_config`` has no key."""
PLUGIN_VERSION = "0.1.0"
KERNEL_ABI = 4
"""Bumped whenever the in-graph ops change, so compile caches of older graphs are not reused."""

Site = tuple[Hook, int]


class EngineOptions(BaseModel):
    """Options of the dynsteer plugin for one engine."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """Turn the plugin on for this engine (an empty dict also enables it)."""
    sites: Annotated[str | list[str], Field(min_length=1)] = "post_block@*"
    """Which (hook, layer) sites get a kernel, e.g. ``"post_block@*"`` or ``"pre_attn@0-3"``."""
    max_rows: int = Field(default=32, ge=1, le=4096)
    """Distinct steering rows in flight (one per distinct per-phase config, global included)."""
    max_steer_norm: float = Field(default=DEFAULT_MAX_STEER_NORM, gt=0, le=1e12)
    """Largest ``‖scale · vector‖`` (L2) one steering entry may add, checked for every spec,
    global entry and registered vector (HTTP 400 / ValueError above it)."""
    max_vectors: int = Field(default=256, ge=0, le=65536)
    """Named vectors that may be registered at once (a full registry answers HTTP 409)."""
    max_probes: int = Field(default=256, ge=0, le=65536)
    """Named probes that may be registered at once (a full registry answers HTTP 409)."""
    capture_lanes: int = Field(default=4, ge=0, le=256)
    """Sites one activation-capture pass records at once; more sites take more passes over the
    prompts. Costs ``capture_lanes * (capture_tokens + 1) * hidden * 4`` bytes of device
    memory per worker (0 turns capture off and frees it)."""
    capture_tokens: int = Field(default=1024, ge=1, le=1 << 20)
    """Prompt tokens one capture round holds (per lane); a longer prompt cannot be captured,
    more prompts take more rounds."""
    plugin_version: str = PLUGIN_VERSION
    """Set by the plugin; part of vLLM's compile-cache key."""
    kernel_abi: int = KERNEL_ABI
    """Set by the plugin; part of vLLM's compile-cache key."""

    @field_validator("sites")
    @classmethod
    def _check_site_grammar(cls, v: str | list[str]) -> str | list[str]:
        for item in _site_items(v):
            _parse_site_item(item, num_layers=None)
        return v


def _site_items(sites: str | list[str]) -> list[str]:
    items = sites.split(",") if isinstance(sites, str) else list(sites)
    return [s.strip() for s in items if s.strip()]


def _parse_layers(text: str, num_layers: int | None) -> list[int]:
    if text == "*":
        return list(range(num_layers)) if num_layers is not None else []
    layers: list[int] = []
    for part in text.split("+"):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad layer range {part!r}: use N, N-M or *")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad layer range {part!r}: {last} < {first}")
        if num_layers is not None and last >= num_layers:
            raise ValueError(
                f"layer {last} in {part!r} does not exist (the model has {num_layers} layers)"
            )
        layers.extend(range(first, last + 1))
    return layers


def _parse_site_item(item: str, num_layers: int | None) -> list[Site]:
    hook, sep, layers = item.partition("@")
    if not sep:
        raise ValueError(f"site {item!r} must look like hook@layers, e.g. post_block@*")
    if hook not in HOOKS:
        raise ValueError(f"site {item!r}: unknown hook {hook!r} (use one of {', '.join(HOOKS)})")
    return [(hook, layer) for layer in _parse_layers(layers, num_layers)]  # type: ignore[misc]


def resolve_sites(sites: str | list[str], num_layers: int,
                  field: str = "dynsteer.sites") -> tuple[Site, ...]:
    """All sites in forward order (layer, then pre_attn < post_attn < post_block).

    Errors start with ``field``, the name the caller knows the value by.
    """
    found: set[Site] = set()
    for item in _site_items(sites):
        try:
            found.update(_parse_site_item(item, num_layers))
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e
    return tuple(sorted(found, key=site_order))


def site_name(site: Site) -> str:
    """``hook@layer``, the name of one site in the site grammar (and in every API)."""
    return f"{site[0]}@{site[1]}"


def site_order(site: Site) -> tuple[int, int]:
    """Sort key of a site in forward order."""
    return site_key(*site)


def options_from_additional_config(additional_config: Any) -> EngineOptions | None:
    """The plugin's options for an engine, or None when the plugin is not enabled for it."""
    raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        if os.environ.get(ENABLE_ENV, "") not in ("1", "true", "True"):
            return None
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config.{CONFIG_KEY} must be a dict, got {type(raw).__name__}")
    try:
        options = EngineOptions.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"additional_config.{CONFIG_KEY}.{field}: {first['msg']}") from e
    return options if options.enabled else None
