"""Every key dynsteer reads from or writes to a request's ``SamplingParams.extra_args``.

One list, so a reader can see at a glance what a request carries and who may set it. A client
sets only :data:`SPEC_KEY`. Every other key starts with :data:`RESERVED_PREFIX`, is written by
the frontend when it admits the request (overwriting anything a client sent; the server
refuses client requests that name one), and is read by the engine core's scheduler or by the
workers.

No vLLM import.
"""

from __future__ import annotations

SPEC_KEY = "dynsteer"
"""A request's spec (and the top-level body field of the HTTP server), set by the client."""
RESERVED_PREFIX = f"{SPEC_KEY}_"
"""Keys that start with this are the frontend's own: a client may not set them."""

WIRE_KEY = "dynsteer_wire"
"""The resolved spec (:mod:`.wire`): what the workers build the request's rows from."""
GLOBAL_KEY = "dynsteer_global"
"""The fingerprint of the global steering a request was admitted under (absent: none). A
request keeps that global steering for its whole life, preemptions included; a change steers
later requests."""
REGISTRY_KEY = "dynsteer_registry"
"""The registry generation a request was admitted under: the names in its spec resolve to the
vectors and probes registered then, even when one is replaced or deleted before the request
is scheduled or while it is preempted."""
CLAIMS_KEY = "dynsteer_rows"
"""The request's row claims, ``{"rows": [keys], "gates": [keys]}``, which the scheduler checks
against the workers' row budget before it admits the request."""
GUARD_KEY = "dynsteer_cache"
"""The request's prefix-cache guard (:mod:`dynsteer.engine_ext.prefix_guard`), read by the
scheduler."""
ACTIVATIONS_KEY = "dynsteer_activations"
"""A request's own capture (``sites``, ``rows``, ``positions``, ``dtype`` and the spec's other
capture fields, with ``stream``), from its spec's ``capture`` (see
:func:`dynsteer.engine_ext.frontend.request_capture.admit`)."""

FRONTEND_KEYS = (WIRE_KEY, GLOBAL_KEY, REGISTRY_KEY, CLAIMS_KEY, GUARD_KEY, ACTIVATIONS_KEY)
"""The keys the frontend writes (all under :data:`RESERVED_PREFIX`)."""
