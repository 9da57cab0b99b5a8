"""Python API on a running offline ``LLM``: global steering and named vectors.

Every call is validated in the frontend first (same checks and messages as per-request specs)
and then applied on every worker through ``collective_rpc``, so all TP ranks stay identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dynsteer.controller.activations import Activations
from dynsteer.controller.spec import GateSpec, SteerEntry, check_session, parse_gate

from ..compat import frontend as vllm_frontend
from ..compat.scheduler import STATS_UTILITY
from . import request_capture
from .control_plane import Change, ControlPlane


class Steering:
    """Control plane of one engine started with ``additional_config={"dynsteer": {...}}``."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        frontend = vllm_frontend.engine_state(llm)
        if frontend is None:
            raise RuntimeError(
                "dynsteer is not enabled on this engine: pass additional_config={'dynsteer': {}}"
            )
        self._frontend = frontend
        self._plane = ControlPlane(frontend)

    def _apply(self, change: Change) -> None:
        vllm_frontend.rpc(self._llm, change.method, change.rpc_args())
        change.commit()

    @property
    def sites(self) -> list[str]:
        """Configured sites, ``hook@layer``, in forward order."""
        return self._frontend.site_names()

    @property
    def hidden_size(self) -> int:
        return self._frontend.hidden_size

    def register_vector(self, name: str, vector: Sequence[float] | np.ndarray, *,
                        replace: bool = False) -> None:
        """Register a named vector usable as ``"vector": name`` in specs; a name that is taken
        raises :class:`.control_plane.ConflictError` unless ``replace``."""
        self._apply(self._plane.register_vector(name, vector, replace=replace))

    def unregister_vector(self, name: str) -> None:
        """Forget a named vector; requests already admitted keep their steering."""
        self._apply(self._plane.unregister_vector(name))

    def vectors(self) -> list[str]:
        """Names of the registered vectors."""
        return sorted(self._frontend.vectors)

    def register_probe(self, name: str, probe: Any = None, *, weights: Any = None,
                       threshold: float = 0.0, sharpness: float = 1.0,
                       replace: bool = False) -> None:
        """Register a named probe usable as ``"probe": name`` in a gate (a taken name raises
        :class:`~dynsteer.engine_ext.frontend.control_plane.ConflictError` unless ``replace``).

        Pass a :class:`dynsteer.probes.Probe` (checked against the served model: fingerprint,
        site; its weights, threshold and sharpness are used) or ``weights=`` with
        ``threshold``/``sharpness``. The monitor site comes from each request's gate
        (``layer``/``hook``).
        """
        if probe is not None:
            self._apply(self._plane.register_probe_object(probe.replace(name=name),
                                                          replace=replace))
            return
        self._apply(self._plane.register_probe(name, weights, threshold, sharpness,
                                               replace=replace))

    def unregister_probe(self, name: str) -> None:
        """Forget a named probe; requests already admitted keep their gate."""
        self._apply(self._plane.unregister_probe(name))

    def probes(self) -> list[str]:
        """Names of the registered probes."""
        return sorted(self._frontend.probes)

    def telemetry(self, output: Any) -> dict[str, Any] | None:
        """Gate telemetry of a request (a ``RequestOutput`` or its id), None if it had no gate.

        Keys: ``tokens_monitored``, ``gated_prefill`` / ``gated_decode`` (tokens with gate >
        0.5), ``first_decode_gated`` (0-based index of the first generated position gated, or
        None), ``first_gated`` (the first position gated, prompt or generated), ``max_score``,
        ``gates`` and ``scores`` (per position, None where not processed; only for gates with
        ``"trace": true``) and ``controller`` (name, ``events``: what it changed from which
        position, ``error``; None without a controller).
        """
        request_id = output if isinstance(output, str) else output.request_id
        return vllm_frontend.rpc(self._llm, "dynsteer_telemetry", (request_id,))[0]

    def activations(self, outputs: Any) -> Activations | list[Any] | None:
        """The activations a finished request captured (its spec's ``capture``): the positions
        and, per site, ``[positions, hidden]``; None if it asked for none. A request sampled
        ``n > 1`` times gives a list instead, one per completion in the order of their
        ``index``.

        ``outputs``: a ``RequestOutput`` (or a request id), giving one result; or a list of
        them, giving a list, collected in one call to the workers (much faster for a batch).
        Collect each request's once, as its output arrives: the rows are freed then, and a
        finished request's rows are reused by later requests when the engine needs the room
        (its status is then ``dropped``).
        """
        single = isinstance(outputs, str) or not isinstance(outputs, Sequence)
        wanted = [outputs] if single else list(outputs)
        per_output = [[(o, None)] if isinstance(o, str) else vllm_frontend.completion_requests(o)
                      for o in wanted]
        found = iter(request_capture.collect(self._llm, [r for rs in per_output for r in rs]))
        results: list[Activations | list[Activations | None] | None] = []
        for o, requests in zip(wanted, per_output, strict=True):
            mine = [next(found) for _ in requests]
            results.append(mine if not isinstance(o, str) and len(o.outputs) > 1 else mine[0])
        return results[0] if single else results

    def flush_capture_sinks(self) -> dict[str, dict[str, int]]:
        """Seal the shards of the engine's capture sinks (``dynsteer.capture_sinks``) whose
        requests finished, once everything queued is written, so ``dynsteer.capture.open``
        reads them; per sink, its counters (``requests``, ``dropped``, ``bytes``, ``shards``,
        summed over the workers that write it). Shards are also sealed when full, after
        ``seal_after_s``, and when the engine stops."""
        totals: dict[str, dict[str, int]] = {}
        for counters in vllm_frontend.rpc(self._llm, "dynsteer_flush_capture_sinks", ()):
            for name, values in (counters or {}).items():
                for key, value in values.items():
                    totals.setdefault(name, {}).setdefault(key, 0)
                    totals[name][key] += value
        return totals

    def capture(self, prompts: Sequence[Sequence[int] | str], sites: str | Sequence[str],
                reduce: str = "last") -> dict[str, Any]:
        """Residual-stream activations of ``prompts`` at ``sites``, computed by this engine.

        ``prompts``: token-id lists or texts (tokenized with the engine's tokenizer). ``sites``:
        configured sites in the site grammar (``"post_block@*"``, ``["post_attn@3"]``; hooks
        are TransformerLens' resid_pre / resid_mid / resid_post). ``reduce``: per prompt, the
        ``last`` prompt token or the ``mean`` over its tokens (``{site: float32 [N, H]}``), or
        ``all`` tokens (``{site: [float32 [len_i, H], ...]}``). The stream is read before the
        site's own steering; global steering, if set, applies. Prompts longer than the engine
        option ``capture_tokens`` are refused; many prompts or more sites than
        ``capture_lanes`` take several rounds and passes.
        """
        from .capture import capture_sync

        return capture_sync(self._llm, prompts, sites, reduce)

    def set_global(self, entries: Sequence[SteerEntry | dict[str, Any]]) -> None:
        """Steer every request admitted from now on with ``entries`` (added to its own
        steering); requests in flight keep the global steering they were admitted under."""
        self._apply(self._plane.set_global(entries))

    def clear_global(self) -> None:
        """Remove global steering."""
        self._apply(self._plane.clear_global())

    def set_session(self, session: str, steer: Sequence[SteerEntry | dict[str, Any]] = (),
                    gate: GateSpec | dict[str, Any] | None = None) -> None:
        """Steer the session's later requests (``{"session": session}`` in their spec):
        ``steer`` is added to their own entries, ``gate`` replaces a gate they do not have.
        What an asynchronous controller's ``set_session`` command does on a server."""
        parsed = gate if gate is None or isinstance(gate, GateSpec) else parse_gate(gate)
        steering = self._plane.session_steering(steer, parsed)
        self._frontend.set_session(check_session(session), steering)

    def clear_session(self, session: str) -> None:
        self._frontend.set_session(check_session(session), None)

    def info(self) -> list[dict[str, Any]]:
        """Per-worker counters (rows in use, live requests, controllers and their checksum,
        events, ...), one dict per worker."""
        return vllm_frontend.rpc(self._llm, "dynsteer_info")

    def cache_stats(self) -> dict[str, int]:
        """Prefix-guard counters of the engine core (blocks withheld from the prefix cache)."""
        return vllm_frontend.engine_core_call(self._llm, STATS_UTILITY)
