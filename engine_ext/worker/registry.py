"""The worker's registry of named vectors and probes, kept by generation.

The frontend numbers each registry change (a *generation*) and writes the generation a request
was admitted under into its extra args (``REGISTRY_KEY``). A request may reach the workers after
a vector or probe it names was replaced or deleted; it must still be steered with what it was
admitted with, so a change makes a new generation and older ones stay as they were (a bounded
history). Resolved specs are cached per generation: requests carrying the same spec share what
it builds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynsteer.controller.contract import Site
from dynsteer.controller.extra_args import REGISTRY_KEY
from dynsteer.controller.wire import F32, WireProbe

from .resolve import Resolved, resolve

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

REGISTRY_HISTORY = 64
"""Registry generations a worker keeps after later changes replaced them."""

RESOLVED_SPECS = 256
"""Distinct resolved specs a worker keeps built (a bounded LRU; identical specs reuse them)."""


@dataclass(frozen=True)
class Generation:
    """The named vectors and probes of one registry generation (never changed in place)."""

    vectors: dict[str, np.ndarray]
    probes: dict[str, WireProbe]
    """Probes in their resolved form (the site comes from each request's gate)."""


class Registry:
    """Registry generations (the current one and :data:`REGISTRY_HISTORY` before it) and the
    specs resolved in them."""

    def __init__(self, hidden_size: int, monitor_sites: Collection[Site]) -> None:
        self.hidden_size = hidden_size
        self.monitor_sites = monitor_sites
        self._generations: OrderedDict[int, Generation] = OrderedDict({0: Generation({}, {})})
        """Oldest first; the current one is last."""
        self.current = 0
        """The current generation's number."""
        self._resolved: OrderedDict[tuple[str, int], Resolved] = OrderedDict()

    @property
    def vectors(self) -> dict[str, np.ndarray]:
        """Registered vectors (current generation)."""
        return self._generations[self.current].vectors

    @property
    def probes(self) -> dict[str, WireProbe]:
        """Registered probes (current generation)."""
        return self._generations[self.current].probes

    # ``generation``: the generation the change creates, numbered by the frontend.
    def register_vector(self, name: str, data: bytes, generation: int) -> None:
        """Add or replace a named vector, given as the little-endian float32 bytes the frontend
        checked."""
        self._change(generation, vectors={**self.vectors, name: np.frombuffer(data, dtype=F32)})

    def unregister_vector(self, name: str, generation: int) -> None:
        """Remove a named vector; unknown names raise ``KeyError``."""
        self._change(generation, vectors=_without(self.vectors, name))

    def register_probe(self, name: str, probe: WireProbe, generation: int) -> None:
        """Add or replace a named probe, given in the resolved form the frontend checked
        (``[weights bytes, threshold, sharpness]``)."""
        self._change(generation, probes={**self.probes, name: probe})

    def update_probe(self, name: str, threshold: float, sharpness: float | None,
                     generation: int) -> None:
        """A registered probe's new threshold (and sharpness); unknown names raise KeyError."""
        weights, _, old_sharpness = self.probes[name]
        self._change(generation, probes={**self.probes, name: [
            weights, threshold, old_sharpness if sharpness is None else sharpness]})

    def unregister_probe(self, name: str, generation: int) -> None:
        """Remove a named probe; unknown names raise ``KeyError``."""
        self._change(generation, probes=_without(self.probes, name))

    def _change(self, generation: int, vectors: dict[str, np.ndarray] | None = None,
                probes: dict[str, WireProbe] | None = None) -> None:
        current = self._generations[self.current]
        self._generations[generation] = Generation(
            current.vectors if vectors is None else vectors,
            current.probes if probes is None else probes)
        self._generations.move_to_end(generation)
        self.current = generation
        while len(self._generations) > REGISTRY_HISTORY + 1:
            self._generations.popitem(last=False)

    def generation_of(self, req_id: str, extra_args: Any) -> int:
        """The generation a request was admitted under (the frontend wrote it); one dropped
        from the history falls back to the current one, with a warning."""
        generation = (extra_args.get(REGISTRY_KEY, self.current)
                      if isinstance(extra_args, dict) else self.current)
        if generation not in self._generations:
            logger.warning("dynsteer: request %s was admitted under a registry changed more "
                           "than %d times since; its names resolve in the current one",
                           req_id, REGISTRY_HISTORY)
            generation = self.current
        return generation

    def resolve(self, wire: dict[str, Any], generation: int) -> Resolved:
        """What a resolved spec builds in ``generation``; identical specs (same key, same
        generation) reuse it. Raises as :func:`.resolve.resolve` does."""
        cache_key = (wire["key"], generation)
        hit = self._resolved.get(cache_key)
        if hit is not None:
            self._resolved.move_to_end(cache_key)
            return hit
        named = self._generations[generation]
        resolved = resolve(wire, named.vectors, named.probes, self.hidden_size,
                           self.monitor_sites)
        self._resolved[cache_key] = resolved
        while len(self._resolved) > RESOLVED_SPECS:
            self._resolved.popitem(last=False)
        return resolved


def _without(registry: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of ``registry`` without ``name`` (KeyError when it is not there)."""
    if name not in registry:
        raise KeyError(name)
    return {k: v for k, v in registry.items() if k != name}
