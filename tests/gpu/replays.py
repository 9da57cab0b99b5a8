"""Counting an engine's CUDA-graph replays from inside its worker (``collective_rpc``): this
module is imported there, so it imports nothing at its top."""

from __future__ import annotations

from typing import Any


def count_replays(worker: Any) -> dict[str, Any]:
    """Runs inside the worker: wraps the graph manager to count FULL-graph replays (once), and
    returns them with the graphs captured so far and the steps whose index dynsteer filled on
    the device, on the host or kept. The V1 runner keeps its graphs elsewhere: for it only the
    runner and the fills are returned."""
    from dynsteer.engine_ext.compat.worker import runner_state

    runner = worker.model_runner
    state = runner_state(runner)
    fills = dict(state.index_fills) if state is not None else {}
    mgr = getattr(runner, "cudagraph_manager", None)
    if mgr is None:
        return {"runner": type(runner).__module__, "index_fills": fills}
    if not hasattr(mgr, "_dynsteer_replays"):
        mgr._dynsteer_replays = 0
        original = mgr.run_fullgraph

        def run_fullgraph(*args: Any, **kwargs: Any) -> Any:
            mgr._dynsteer_replays += 1
            return original(*args, **kwargs)

        mgr.run_fullgraph = run_fullgraph
    return {"replays": mgr._dynsteer_replays, "graphs": len(mgr.graphs),
            "runner": type(runner).__module__, "index_fills": fills}


def replays(llm: Any) -> dict[str, Any]:
    """:func:`count_replays` of the engine's first worker."""
    return llm.collective_rpc(count_replays)[0]
