"""Session namespaces: with API keys configured, a session belongs to the key that names it.

A request's ``session`` (in its spec) and a controller command's ``session`` are both turned
into ``<namespace>/<session>``, the namespace a digest of the API key the caller presented
(its bearer key, on every route: those vLLM's ``--api-key`` does not guard, such as
``/invocations``, too); so a tenant reaches only sessions made under its own key, whatever
name it sends. A request without a configured key (no bearer, or a wrong one) gets a
namespace of its own (:data:`ANONYMOUS`), so it cannot join a tenant's session by sending that
tenant's namespaced name. Without API keys there is
one namespace (the name as given). Events carry the namespaced name; a command may send it
back as it is (a name already in the caller's own namespace is not prefixed again).

Requests are namespaced at admission (:mod:`dynsteer.engine_ext.frontend.caller`), from the
:class:`~dynsteer.engine_ext.frontend.caller.Caller` the middleware derives here from the
request's bearer key.
"""

from __future__ import annotations

import hashlib

from ..frontend.caller import Caller
from .settings import is_configured_key

NAMESPACE_CHARS = 16

ANONYMOUS = "-/"
"""Namespace prefix of sessions of requests without a configured key (no digest spells it)."""
CALLER_PATTERN = rf"^(?:[0-9a-f]{{{NAMESPACE_CHARS}}}/|-/)$"
"""A key namespace as routes take it (:func:`key_namespace`'s form, or :data:`ANONYMOUS`)."""


def key_namespace(api_key: str) -> str:
    """The session-name prefix of a tenant's API key."""
    return hashlib.blake2b(api_key.encode(), digest_size=NAMESPACE_CHARS // 2).hexdigest() + "/"


def client(api_key: str | None, api_keys: list[str]) -> Caller:
    """The caller presenting ``api_key`` (None: no bearer) to a server with ``api_keys``."""
    if not api_keys:
        return Caller(namespace=None, client=True)
    if api_key is not None and is_configured_key(api_key, api_keys):
        return Caller(namespace=key_namespace(api_key), client=True)
    return Caller(namespace=ANONYMOUS, client=True)

