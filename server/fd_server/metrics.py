"""/metrics: Prometheus text for one app, in its own registry (several apps can share a process).

Engine-side figures (queue lengths, KV cache, prefix cache, token and preemption totals) are
read from the engine client at scrape time: the core's latest report, sent after every step
and, when it is idle, every heartbeat.
Latencies are measured here, per request, when it finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fd_server.streams import RequestStream

log = logging.getLogger("fd_server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# (key in client.metrics(), metric name, help, kind)
_ENGINE_FIGURES = (
    ("num_running", "fd_num_requests_running", "Sequences the engine is running.", "gauge"),
    ("num_waiting", "fd_num_requests_waiting", "Sequences waiting for the engine.", "gauge"),
    ("kv_cache_usage", "fd_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).", "gauge"),
    ("num_free_blocks", "fd_kv_cache_free_blocks", "KV-cache blocks free.", "gauge"),
    ("num_blocks", "fd_kv_cache_total_blocks", "KV-cache blocks usable by requests.", "gauge"),
    ("prompt_tokens_total", "fd_prompt_tokens", "Prompt tokens the engine accepted.", "counter"),
    ("generation_tokens_total", "fd_generation_tokens", "Tokens the engine generated.", "counter"),
    ("preemptions_total", "fd_preemptions", "Sequences preempted for lack of KV-cache blocks (by swap or recompute).",
     "counter"),
    ("swapped_out_total", "fd_preemptions_swap",
     "Preemptions that swapped the sequence's KV cache out to host memory (--swap-space).", "counter"),
    ("recomputed_total", "fd_preemptions_recompute",
     "Preemptions that dropped the sequence's KV cache, to be recomputed when it resumes.", "counter"),
    ("num_swapped", "fd_num_requests_swapped",
     "Sequences whose KV cache is swapped out to host memory, waiting to resume.", "gauge"),
    ("prompt_tokens_computed_total", "fd_prompt_tokens_computed",
     ("Prompt tokens the model computed: prefix-cache hits and the shared prompt of n>1 requests are "
      "not computed again, recomputation after a preemption is counted again."), "counter"),
    ("prefix_cache_queried_tokens_total", "fd_prefix_cache_queries",
     ("Tokens looked up in the prefix cache when sequences were admitted, readmissions after a "
      "recompute preemption included (with prefix caching off, every lookup misses)."), "counter"),
    ("prefix_cache_hit_tokens_total", "fd_prefix_cache_hits",
     "Tokens of those lookups the prefix cache supplied (whole blocks; their KV cache was reused).", "counter"),
    ("prefix_cache_hit_rate", "fd_prefix_cache_hit_rate",
     ("fd_prefix_cache_hits_total / fd_prefix_cache_queries_total since the engine started "
      "(0 before any lookup)."), "gauge"),
    ("prefix_cache_blocks", "fd_prefix_cache_blocks",
     "KV-cache blocks holding a cached prefix, in use or free until reused.", "gauge"),
    ("prefix_cache_evictions_total", "fd_prefix_cache_evictions",
     "Cached prefix blocks dropped from the prefix cache to be reused for other tokens.", "counter"),
    ("report_age_seconds", "fd_engine_report_age_seconds",
     ("Seconds since the engine core last reported (after every step; every 0.25 s when idle): the age of "
      "the engine figures here. Past --heartbeat-timeout, /health is 503."), "gauge"),
)


class _EngineCollector(Collector):
    def __init__(self, client: Any) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        try:
            figures = self.client.metrics()
        except Exception as exc:  # a dead engine has no figures; the other metrics still matter
            log.debug("engine metrics unavailable: %s", exc)
            return
        for key, name, doc, kind in _ENGINE_FIGURES:
            if key not in figures:
                continue
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(figures[key]))


class ServerMetrics:
    def __init__(self, client: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(client))
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("fd_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("fd_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.",
                              labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("fd_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("fd_request_success", "Requests that finished, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)

    def observe(self, stream: RequestStream) -> None:
        """Record a request that finished normally."""
        out = stream.latest
        if out is None or stream.finished_at is None:
            return
        model = self.model_name
        self.e2e.labels(model).observe(stream.finished_at - stream.arrival)
        if stream.first_token_at is not None:
            self.ttft.labels(model).observe(stream.first_token_at - stream.arrival)
            tokens = max((len(o.token_ids) for o in out.outputs), default=0)
            if tokens > 1:
                self.tpot.labels(model).observe((stream.finished_at - stream.first_token_at) / (tokens - 1))
        for o in out.outputs:
            self.finished.labels(model, o.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
