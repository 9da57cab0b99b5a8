"""Global steering on a worker: what every request's rows add besides its own spec.

A change applies to requests admitted after it (the frontend writes the key of the global
steering a request was admitted under into its extra args, ``GLOBAL_KEY``, and its prefix-cache
key names it); live requests keep the one they were admitted under to their end. So the worker
holds the current global steering, every one a live request holds (refcounted), and a bounded
history of replaced ones for requests admitted just before a change that reach the workers
after it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynsteer.controller.extra_args import GLOBAL_KEY
from dynsteer.controller.wire import RawEntry

from .resolve import UNSTEERED, Contents, Projections, entry_contents

logger = logging.getLogger("vllm.dynsteer." + __name__.rsplit(".", 1)[-1])

NO_GLOBAL = "-"
"""Key of "no global steering"."""

GLOBAL_HISTORY = 16
"""Global steerings a worker keeps after they were replaced, beyond those live requests hold."""


@dataclass(frozen=True)
class GlobalSteering:
    """One global steering, resolved: what a row adds to a request's own steering."""

    entries: list[RawEntry]
    adds: dict[str, Contents]
    projections: dict[str, Projections]


class GlobalSteerings:
    """Global steerings by key, least recently set or released first."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, GlobalSteering] = OrderedDict(
            {NO_GLOBAL: GlobalSteering([], UNSTEERED.own, UNSTEERED.projections)})
        self._users: dict[str, int] = {}
        """Live requests per key."""
        self.current = NO_GLOBAL
        """The key requests admitted from now on carry."""

    def __len__(self) -> int:
        return len(self._held)

    def __getitem__(self, key: str) -> GlobalSteering:
        return self._held[key]

    def set(self, entries: list[RawEntry], key: str, vectors: Mapping[str, np.ndarray],
            hidden_size: int) -> None:
        """Replace the current global steering (resolved entries, see
        :mod:`dynsteer.controller.wire`; named vectors from ``vectors``)."""
        key = key if entries else NO_GLOBAL
        self._held[key] = GlobalSteering(entries, *entry_contents(entries, vectors, hidden_size))
        self._held.move_to_end(key)
        self.current = key
        self._forget()

    def hold(self, req_id: str, extra_args: Any) -> str:
        """The key of the global steering a request was admitted under (the frontend wrote
        it), held until :meth:`release`; one dropped from the history falls back to the
        current one, with a warning."""
        key = extra_args.get(GLOBAL_KEY, NO_GLOBAL) if isinstance(extra_args, dict) else NO_GLOBAL
        if key not in self._held:
            logger.warning("dynsteer: request %s was admitted under a global steering replaced "
                           "more than %d times since; it runs under the current one",
                           req_id, GLOBAL_HISTORY)
            key = self.current
        self._users[key] = self._users.get(key, 0) + 1
        return key

    def release(self, key: str) -> None:
        """A request holding ``key`` finished."""
        users = self._users[key] - 1
        if users:
            self._users[key] = users
            return
        del self._users[key]
        self._held.move_to_end(key)
        self._forget()

    def _forget(self) -> None:
        """Drop replaced global steerings no live request holds, beyond the history."""
        spare = [k for k in self._held if k not in (NO_GLOBAL, self.current)
                 and k not in self._users]
        for key in spare[:max(0, len(spare) - GLOBAL_HISTORY)]:
            del self._held[key]
