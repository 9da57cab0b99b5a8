"""Prometheus metrics of dynsteer on vLLM's ``/metrics``.

A custom collector in the default registry (the one vLLM's ``/metrics`` serves with one API
server process): frontend counters are read live, worker counters (TP rank 0; every rank sees
the same tokens) come from the refresh the middleware runs before each scrape.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..worker.host_time import BUCKETS_US
from .runtime import DynsteerServer

logger = logging.getLogger("vllm.dynsteer.metrics")


class DynsteerCollector(Collector):
    def __init__(self, server: DynsteerServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        counters = self.server.frontend.counters
        steered = CounterMetricFamily(
            "dynsteer_requests_steered", "Requests admitted with steering, by kind "
            "(static: own or global entries; gated: a probe gate)", labels=["kind"])
        steered.add_metric(["static"], counters.requests_static)
        steered.add_metric(["gated"], counters.requests_gated)
        yield steered
        yield CounterMetricFamily("dynsteer_requests_rejected",
                                  "Requests whose steering spec failed validation",
                                  value=counters.requests_rejected)
        stats = self.server.worker_stats
        engine_sinks = stats.get("capture_sinks", {})  # written by the workers (stage 0)
        for key, help_text in (
            ("requests", "Requests a capture sink wrote into sealed shards"),
            ("dropped", "Requests a capture sink dropped (queue full under 'drop', failed "
                        "write)"),
            ("bytes", "Bytes of a capture sink's sealed shards"),
        ):
            family = CounterMetricFamily(f"dynsteer_capture_sink_{key}", help_text,
                                         labels=["sink"])
            for name, sink in sorted(self.server.sinks.items()):
                family.add_metric([name], getattr(sink.counters, key, 0))
            for name, counters in sorted(engine_sinks.items()):
                family.add_metric([name], counters.get(key, 0))
            yield family
        for key, help_text in (
            ("tokens_monitored", "Tokens whose gate was computed, by monitor site"),
            ("tokens_gated", "Tokens whose gate was above 0.5, by monitor site"),
        ):
            family = CounterMetricFamily(f"dynsteer_{key}", help_text, labels=["site"])
            for site, value in sorted(stats.get(key, {}).items()):
                family.add_metric([site], value)
            yield family
        yield GaugeMetricFamily("dynsteer_rows_in_use", "Steering rows in use (TP rank 0)",
                                value=stats.get("rows_in_use", 0))
        yield GaugeMetricFamily("dynsteer_rows_capacity", "Steering rows available (max_rows)",
                                value=self.server.frontend.options.max_rows)
        yield CounterMetricFamily("dynsteer_rows_rejected",
                                  "Steering configs that found no free row (ran unsteered)",
                                  value=stats.get("rows_rejected", 0))
        for key, help_text in (
            ("live_requests", "Requests the workers hold (steered or not; TP rank 0)"),
            ("steered_requests_live", "Live requests with steering on the workers"),
            ("probe_rows_in_use", "Probe rows in use (capacity: max_gates)"),
            ("capture_rows_in_use", "Capture rows held by capturing requests (capacity: "
                                    "capture_tokens)"),
            ("global_steerings_held", "Global steerings the workers keep (the current one, "
                                      "those live requests were admitted under, history)"),
        ):
            yield GaugeMetricFamily(f"dynsteer_{key}", help_text, value=stats.get(key, 0))
        guard = self.server.guard_stats
        yield CounterMetricFamily(
            "dynsteer_prefix_blocks_withheld", "Full KV blocks never put in the prefix cache "
            "because they hold dynamically steered (or unconfirmed) KV",
            value=guard.get("blocks_withheld", 0))
        yield CounterMetricFamily(
            "dynsteer_requests_waited_for_rows", "Requests the scheduler kept waiting because "
            "their steering or probe rows would not fit (max_rows, max_gates)",
            value=guard.get("requests_waited_for_rows", 0))
        yield GaugeMetricFamily(
            "dynsteer_requests_waiting_for_rows", "Requests kept waiting for a row at the last "
            "step", value=guard.get("waiting_for_rows", 0))
        yield CounterMetricFamily(
            "dynsteer_prefix_guarded_requests", "Controlled gated requests whose blocks were "
            "cached only once reported free of dynamic steering",
            value=guard.get("guarded_requests", 0))
        yield from _host_time_metrics(stats.get("host_time", {}))
        fills = CounterMetricFamily(
            "dynsteer_index_fills", "Steps whose per-token index was filled, by where: the "
            "device (vLLM's V2 runner on CUDA) or the host (capture, controllers, gate traces, "
            "the V1 runner, CPU); kept: the device path's steps that kept the index of the "
            "step before (the same decode batch, each request continuing where its last step "
            "ended)", labels=["on"])
        for where, value in sorted(stats.get("index_fills", {}).items()):
            fills.add_metric([where], value)
        yield fills
        yield from _controller_metrics(stats, self.server.commands)
        yield GaugeMetricFamily("dynsteer_vectors_registered", "Named vectors",
                                value=len(self.server.frontend.vectors))
        yield GaugeMetricFamily("dynsteer_probes_registered", "Named probes",
                                value=len(self.server.frontend.probes))
        yield GaugeMetricFamily("dynsteer_global_entries", "Global steering entries",
                                value=len(self.server.frontend.global_entries))


def _host_time_metrics(host_time: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Host time of single calls of dynsteer's worker hooks on TP rank 0 (see
    :mod:`..worker.host_time`): ``_sum / _count`` of ``step`` is the host cost per forward,
    the buckets show the tail (a slow admission stretches the step it runs in)."""
    family = HistogramMetricFamily(
        "dynsteer_worker_host_seconds", "Host time of one call of a dynsteer worker hook "
        "(TP rank 0), by hook: admit and finish once per request, step (index fill) and "
        "output (telemetry fold, prefix-guard report) once per forward", labels=["hook"])
    for hook, values in sorted(host_time.items()):
        cumulative, buckets = 0, []
        for bound, count in zip((*BUCKETS_US, None), values["buckets"], strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound is None else str(bound / 1e6), cumulative))
        family.add_metric([hook], buckets, sum_value=values["us"] / 1e6)
    yield family
    cpu = CounterMetricFamily(
        "dynsteer_worker_host_cpu_seconds", "CPU time of the calling thread inside dynsteer's "
        "worker hooks (TP rank 0), by hook; dynsteer_worker_host_seconds_sum minus this is "
        "time the hooks waited (for the GIL held by the engine's other threads, or the GPU)",
        labels=["hook"])
    for hook, values in sorted(host_time.items()):
        cpu.add_metric([hook], values.get("cpu_us", 0.0) / 1e6)
    yield cpu


def _controller_metrics(stats: dict, commands: Any) -> Iterator[Metric]:
    """Controllers (TP rank 0), the events socket and the commands socket."""
    per = stats.get("controllers", {})
    for key, kind, help_text in (
        ("requests", CounterMetricFamily, "Requests admitted with the controller"),
        ("calls", CounterMetricFamily, "Python controller steps run"),
        ("seconds", CounterMetricFamily, "Host time in Python controller steps"),
        ("errors", CounterMetricFamily, "Controller exceptions (each disables it for the "
                                        "requests of that call)"),
    ):
        family = kind(f"dynsteer_controller_{key}", help_text, labels=["controller"])
        for name, values in sorted(per.items()):
            family.add_metric([name], values[key])
        yield family
    info = InfoMetricFamily("dynsteer_controller_checksum", "CRC of every controller action "
                            "applied so far on TP rank 0 (compare with the info route's "
                            "per-rank values)")
    info.add_metric([], {"crc": stats.get("controller_checksum", "00000000"),
                         "steps": str(stats.get("controller_checked_steps", 0))})
    yield info
    for key, help_text in (("events_published", "Controller events sent"),
                           ("events_dropped", "Controller events dropped (queue full)")):
        yield CounterMetricFamily(f"dynsteer_{key}", help_text, value=stats.get(key, 0))
    handled = CounterMetricFamily("dynsteer_commands_handled", "Controller commands applied",
                                  labels=["type"])
    rejected = CounterMetricFamily("dynsteer_commands_rejected",
                                   "Controller command frames refused", labels=["reason"])
    if commands is not None:
        for name, value in sorted(commands.handled.items()):
            handled.add_metric([name], value)
        for name, value in sorted(commands.rejected.items()):
            rejected.add_metric([name], value)
    yield handled
    yield rejected


_installed: DynsteerCollector | None = None


def install_collector(server: DynsteerServer) -> None:
    """Register the collector once per process (a re-init points it at the new server)."""
    global _installed
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("dynsteer: PROMETHEUS_MULTIPROC_DIR is set (several API server "
                       "processes); dynsteer metrics are not exported in that mode")
        return
    if _installed is None:
        _installed = DynsteerCollector(server)
        REGISTRY.register(_installed)
    _installed.server = server
