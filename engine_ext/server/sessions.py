"""Session namespaces: with API keys configured, a session belongs to the key that names it.

A request's ``session`` (in its spec) and a controller command's ``session`` are both turned
into ``<namespace>/<session>``, the namespace a digest of the API key the caller presented;
so a tenant reaches only sessions made under its own key, whatever name it sends. A request
without a configured key gets a namespace of its own (:data:`ANONYMOUS`), so it cannot join a
tenant's session by sending that tenant's namespaced name. Without API keys there is one
namespace (the name as given). Events carry the namespaced name; a command may send it back
as it is (a name already in the caller's own namespace is not prefixed again).
"""

from __future__ import annotations

import hashlib

NAMESPACE_CHARS = 16


ANONYMOUS = "-/"
"""Namespace prefix of sessions of requests without a configured key (no digest spells it)."""


def namespaced(session: str, api_key: str | None) -> str:
    if api_key is None:
        return session
    prefix = hashlib.blake2b(api_key.encode(),
                             digest_size=NAMESPACE_CHARS // 2).hexdigest() + "/"
    return session if session.startswith(prefix) else prefix + session


def anonymous(session: str) -> str:
    """A session of a request without a configured key, while keys are configured."""
    return ANONYMOUS + session
