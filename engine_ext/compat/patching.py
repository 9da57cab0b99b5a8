"""How the adapter changes vLLM: replace a class attribute once, patch a module when imported.

``register()`` runs in every vLLM process, the API server included; importing the model-runner
modules there just to patch them would cost seconds. A post-import hook patches a module only in
the processes that import it anyway.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the real loader of watched modules so callbacks run after they execute."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec):  # type: ignore[override]
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(self._name, [])
        for callback in callbacks:
            callback(module)


_finder = _Finder()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported; at once if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


_ORIGINAL = "_dynsteer_original_"


def patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` (a class or a module attribute) by ``make(original)``, once:
    ``register()`` may run several times in one process."""
    if _ORIGINAL + name in vars(owner):  # not hasattr: a patched base class must not count
        return
    original = getattr(owner, name)
    setattr(owner, _ORIGINAL + name, original)
    setattr(owner, name, functools.wraps(original)(make(original)))
