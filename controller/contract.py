"""The contract both sides of dynsteer share: hooks, sites, names, keys, the float32 codec.

Imported by clients, the HTTP layer, the frontend, the engine core and the workers, so it is
cheap (no pydantic model, no vLLM, no torch) and every rule exists once:

* **hooks and sites**: a *site* is one ``(hook, layer)`` pair, written ``hook@layer``
  (:func:`site_name`, the only formatter); a list of sites is written ``hook@layers``
  (``post_block@*``, ``pre_attn@0-3``, ``post_attn@1+5``, ``post_block@50%``: the layer at
  half the depth), several separated by commas (:func:`resolve_sites`, the only parser);
  sites sort in forward order (:func:`site_order`);
* **names** of registered vectors and probes (:data:`NAME_PATTERN`);
* **keys** in vLLM's ``SamplingParams.extra_args`` (:data:`.extra_args.SPEC_KEY`);
* **float32 on the wire**: little-endian float32 bytes (:func:`f32_bytes`), in JSON as their
  base64 (:func:`encode_f32`, :func:`decode_f32`);
* the messages for a site the engine was not configured with (:func:`unconfigured_site`), that
  the model's layers do not have (:func:`missing_site`) or that the engine does not monitor
  (:func:`unmonitored_site`).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Literal

import numpy as np

Hook = Literal["pre_attn", "post_attn", "post_block"]
"""Residual-stream sites of a decoder layer (TransformerLens: resid_pre, resid_mid, resid_post)."""
HOOKS: tuple[Hook, ...] = ("pre_attn", "post_attn", "post_block")

Site = tuple[Hook, int]
"""One ``(hook, layer)`` pair."""

NAME_RULE = "1-64 characters from A-Z a-z 0-9 _ . -, not starting with '.'"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
"""Names of probes and vectors end up in file names, URLs and metric labels, so they are kept to
a safe alphabet; a leading dot is refused (``.``, ``..`` and hidden files)."""

F32 = np.dtype("<f4")
"""Little-endian float32: the byte order of every vector on the wire, whatever the machine."""


class SpecError(ValueError):
    """A steering spec or value that cannot be served; the message names the field and the fix.

    (Re-exported by :mod:`dynsteer.controller.spec`, where it is documented for clients.)
    """


# ---- sites -------------------------------------------------------------------------------
def site_name(site: tuple[str, int]) -> str:
    """``hook@layer``: the name of one site in the site grammar and in every API."""
    return f"{site[0]}@{site[1]}"


def unconfigured_site(site: tuple[str, int]) -> str:
    """Why ``site`` cannot be used, and the fix (callers prefix the field at fault)."""
    name = site_name(site)
    return f"{name} is not a configured site; add '{name}' to the engine option dynsteer.sites"


def missing_site(site: tuple[str, int], why: str) -> str:
    """Why ``site`` cannot exist in the served model (``why``: the layer class, its layout and
    the hook it lacks), and the fix."""
    return (f"{site_name(site)} does not exist: layer {site[1]} {why}; steer pre_attn or "
            f"post_block of that layer instead")


def unmonitored_site(site: tuple[str, int]) -> str:
    """Why a probe cannot read, or a capture record, ``site``, and the fix."""
    name = site_name(site)
    return (f"{name} is not a monitor site; add '{name}' to the engine option "
            "dynsteer.monitor_sites")


def parse_site_name(name: str, field: str = "site") -> Site:
    """Inverse of :func:`site_name` (ValueError naming ``field``)."""
    hook, sep, layer = str(name).partition("@")
    if not sep or hook not in HOOKS or not layer.isdigit():
        raise ValueError(f"{field}: {name!r} is not a site (hook@layer, hook one of "
                         f"{', '.join(HOOKS)})")
    return hook, int(layer)  # type: ignore[return-value]


def site_order(hook: str, layer: int) -> tuple[int, int]:
    """Forward order of a site: layer first, then pre_attn < post_attn < post_block."""
    return layer, HOOKS.index(hook)  # type: ignore[arg-type]


def _site_items(sites: str | list[str]) -> list[str]:
    items = sites.split(",") if isinstance(sites, str) else list(sites)
    return [s.strip() for s in items if s.strip()]


def _parse_layers(text: str, num_layers: int | None) -> list[int]:
    if text == "*":
        return list(range(num_layers)) if num_layers is not None else []
    layers: list[int] = []
    for part in text.split("+"):
        if part.endswith("%"):
            layers.extend(_depth_layer(part, num_layers))
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad layer range {part!r}: use N, N-M, P% or *")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad layer range {part!r}: {last} < {first}")
        if num_layers is not None and last >= num_layers:
            raise ValueError(
                f"layer {last} in {part!r} does not exist (the model has {num_layers} layers)"
            )
        layers.extend(range(first, last + 1))
    return layers


def _depth_layer(part: str, num_layers: int | None) -> list[int]:
    """``P%``: the layer at P percent of the depth (``0%`` the first, ``100%`` the last)."""
    percent = part[:-1]
    if not percent.isdigit() or int(percent) > 100:
        raise ValueError(f"bad layer depth {part!r}: use 0% to 100%")
    if num_layers is None:
        return []
    return [min(num_layers - 1, int(percent) * num_layers // 100)]


def _parse_site_item(item: str, num_layers: int | None) -> list[Site]:
    hook, sep, layers = item.partition("@")
    if not sep:
        raise ValueError(f"site {item!r} must look like hook@layers, e.g. post_block@*")
    if hook not in HOOKS:
        raise ValueError(f"site {item!r}: unknown hook {hook!r} (use one of {', '.join(HOOKS)})")
    return [(hook, layer) for layer in _parse_layers(layers, num_layers)]  # type: ignore[misc]


def check_site_grammar(sites: str | list[str]) -> None:
    """Raise ValueError when ``sites`` is not in the grammar (no model needed)."""
    for item in _site_items(sites):
        _parse_site_item(item, num_layers=None)


def resolve_sites(sites: str | list[str], num_layers: int,
                  field: str = "dynsteer.sites") -> tuple[Site, ...]:
    """All sites of ``sites`` in a model of ``num_layers`` layers, in forward order.

    Errors start with ``field``, the name the caller knows the value by.
    """
    found: set[Site] = set()
    for item in _site_items(sites):
        try:
            found.update(_parse_site_item(item, num_layers))
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e
    return tuple(sorted(found, key=lambda s: site_order(*s)))


# ---- float32 on the wire -----------------------------------------------------------------
def f32_bytes(values: Any) -> bytes:
    """The little-endian float32 bytes of ``values`` (what the resolved form and worker RPCs
    carry, :mod:`dynsteer.controller.wire`)."""
    return np.ascontiguousarray(values, dtype=F32).tobytes()


def encode_f32(values: Any) -> str:
    """Base64 of little-endian float32 (what ``*_b64`` fields carry)."""
    return base64.b64encode(f32_bytes(values)).decode("ascii")


def decode_f32(field: str, text: Any) -> np.ndarray:
    """Inverse of :func:`encode_f32` (a writable native float32 array, never empty); a
    :class:`SpecError` naming ``field`` when malformed."""
    if not isinstance(text, str):
        raise SpecError(f"{field}: must be a string (base64 of little-endian float32), got "
                        f"{type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise SpecError(f"{field}: not valid base64 ({e})") from e
    if not raw or len(raw) % 4:
        raise SpecError(f"{field}: decodes to {len(raw)} bytes; expected a non-empty multiple "
                        "of 4 (little-endian float32)")
    return np.frombuffer(raw, dtype=F32).astype(np.float32)
