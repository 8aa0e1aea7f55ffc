"""Prometheus metrics of one server: requests, tokens, latency, time to first token, engine steps (wall and
CPU time, host-device synchronisations) and the tokens they computed, prompt-prefix reuse, queue, KV
capacity, adapters, FedDPA weights.

A registry per app (not prometheus-client's global one), so several apps can live in one process
(tests). Gauges read the engine and pool at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from serving.engine import StepReport


class Metrics:
    """The server's metric families (names follow LoRAX/vLLM conventions with a ``fedmosaic_`` prefix)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fedmosaic_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("fedmosaic_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("fedmosaic_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("fedmosaic_generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("fedmosaic_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.ttft = Histogram("fedmosaic_time_to_first_token_seconds",
                              "Time from submission to the first generated token (queue, prefill, routing)",
                              ["endpoint"], registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.step = Histogram("fedmosaic_engine_step_seconds", "Engine step wall time (prefill, decode or mixed)",
                              ["kind"], registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.step_cpu = Histogram("fedmosaic_engine_step_cpu_seconds", "Engine thread CPU time per step (host work; "
                                  "on CUDA a spinning synchronisation counts too)", ["kind"], registry=r,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.syncs = Counter("fedmosaic_engine_syncs", "Host-device synchronisations in engine steps (counted with "
                             "--count-syncs only)", ["kind"], registry=r)
        self.sync_wait = Counter("fedmosaic_engine_sync_seconds", "Seconds engine steps spent in host-device "
                                 "synchronisations (--count-syncs only)", ["kind"], registry=r)
        self.feddpa_weight = Histogram("fedmosaic_feddpa_local_weight", "FedDPA local-adapter weight a per request",
                                       registry=r, buckets=tuple(i / 10 for i in range(11)))
        self.queue = Gauge("fedmosaic_queue_size", "Requests waiting to join the batch", registry=r)
        self.running = Gauge("fedmosaic_running_requests", "Requests in the running batch", registry=r)
        self.adapters = Gauge("fedmosaic_loaded_adapters", "Adapters loaded in the model", registry=r)
        self.prefill_computed = Counter(
            "fedmosaic_engine_prefill_tokens", "Prompt tokens run through prefill passes (a FedDPA request's "
            "routing and exact passes both count; tokens of a reused prefix do not)", registry=r)
        self.decode_rows = Counter("fedmosaic_engine_decode_rows", "Rows decoded by engine steps", registry=r)
        self.kv_slots = Gauge("fedmosaic_kv_slots", "KV cache slots: requests decoded at once", registry=r)
        self.max_model_len = Gauge("fedmosaic_max_model_len", "Positions per slot (prompt plus completion)",
                                   registry=r)
        self.kv_bytes = Gauge("fedmosaic_kv_cache_bytes", "The KV cache at full length (on a CPU it grows to it "
                              "on demand)", registry=r)
        self._prefixes = _PrefixCollector()
        r.register(self._prefixes)

    def bind(self, queue: Callable[[], float], running: Callable[[], float], adapters: Callable[[], float],
             prefixes: Callable[[], tuple[int, int]] | None = None) -> None:
        """Make the gauges read live values at scrape time (``prefixes``: prefix-cache hits, reused tokens)."""
        self.queue.set_function(queue)
        self.running.set_function(running)
        self.adapters.set_function(adapters)
        self._prefixes.read = prefixes

    def capacity(self, slots: int, max_model_len: int, kv_bytes: int) -> None:
        """Record what the engine holds (its slots and context, sized to the machine unless given)."""
        self.kv_slots.set(slots)
        self.max_model_len.set(max_model_len)
        self.kv_bytes.set(kv_bytes)

    def observe_step(self, report: StepReport) -> None:
        """Record one engine step (an :attr:`serving.engine.Engine.step_observers` callback)."""
        self.step.labels(report.kind).observe(report.seconds)
        self.step_cpu.labels(report.kind).observe(report.cpu_seconds)
        if report.syncs:
            self.syncs.labels(report.kind).inc(report.syncs)
            self.sync_wait.labels(report.kind).inc(report.sync_seconds)
        self.prefill_computed.inc(report.prefill_tokens)
        self.decode_rows.inc(report.decode_rows)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class _PrefixCollector(Collector):
    """The engine's prompt-prefix reuse counters (:mod:`serving.engine.prefix_cache`), read at scrape time."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[int, int]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        hits, tokens = self.read() if self.read is not None else (0, 0)
        yield CounterMetricFamily("fedmosaic_prefix_cache_hits", "Prompt passes that reused a cached prefix",
                                  value=hits)
        yield CounterMetricFamily("fedmosaic_prefix_cache_reused_tokens",
                                  "Prompt tokens copied from a cached prefix instead of computed", value=tokens)
