"""dynsteer on vLLM's OpenAI-compatible server: routes, middleware and metrics.

Loaded by vLLM as the ``vllm.endpoint_plugins`` entry point ``dynsteer`` (allowlisted through
``VLLM_PLUGINS``, which ``dynsteer serve`` sets), so the routes share the server's port, app,
auth middleware and ``/metrics``.
"""
