"""/metrics: Prometheus text for one app, in its own registry (several apps can share a process).

Names, types, labels and histogram buckets are vLLM's (``vllm:x`` is ``fd:x`` here), so
dashboards and alerts written for vLLM work once the prefix is changed; docs/METRICS.md has the
table and ``docs/grafana/fd.json`` a dashboard. Every series carries ``model_name`` (the served
model name) and ``engine`` (always ``"0"``: one engine core per server), vLLM's label set.

Engine-side figures (queue lengths, KV cache, prefix cache, token and preemption totals) are
read from the engine client at scrape time: the core's latest report, sent after every step
and, when it is idle, every heartbeat. Latencies are observed here as outputs arrive: the first
token and every later one (``fd:inter_token_latency_seconds``, one observation per token of
each sequence after its first) at once, the rest when a request finishes. With several HTTP
processes (``fd serve --api-server-count``, which sets ``PROMETHEUS_MULTIPROC_DIR`` for them)
each records its observations in that folder and /metrics, from whichever process answers,
sums every process's (``prometheus_client``'s multiprocess mode); the engine's figures are the
same in each.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from fd_core.engine.outputs import RequestOutput
from fd_server.streams import RequestStream

log = logging.getLogger("fd_server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "fd:"
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, so that quantiles from either engine are comparable
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's token-gap buckets with three more below its first (10 ms), where a GPU's decode steps
# fall (3-8 ms): vLLM's put them all in one bucket, so no quantile under 10 ms could be read.
# Every vLLM boundary is kept, so its queries still work.
_TOKEN_GAP_BUCKETS = (0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)

# (key in client.metrics(), metric name without the prefix, help, kind); a counter's samples
# get "_total" appended, as prometheus_client does for every counter
_ENGINE_FIGURES = (
    ("num_running", "num_requests_running", "Sequences in the engine's running batch.", "gauge"),
    ("num_waiting", "num_requests_waiting", "Sequences waiting to be scheduled.", "gauge"),
    ("num_swapped", "num_requests_swapped",
     "Sequences whose KV cache is swapped out to host memory, waiting to resume (--swap-space).", "gauge"),
    ("kv_cache_usage", "kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use, 1 means 100 percent.",
     "gauge"),
    ("preemptions_total", "num_preemptions",
     "Sequences preempted for lack of KV-cache blocks (by swap or recompute).", "counter"),
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of the sequences the engine accepted.", "counter"),
    ("generation_tokens_total", "generation_tokens", "Tokens the engine generated.", "counter"),
    ("prefix_cache_queried_tokens_total", "prefix_cache_queries",
     ("Prefix cache queries, in tokens looked up when sequences were admitted (readmissions after a "
      "recompute preemption included; with prefix caching off every lookup misses)."), "counter"),
    ("prefix_cache_hit_tokens_total", "prefix_cache_hits",
     "Prefix cache hits, in tokens of those lookups the cache supplied (whole blocks).", "counter"),
    # fd's own
    ("num_free_blocks", "kv_cache_free_blocks", "KV-cache blocks free.", "gauge"),
    ("num_blocks", "kv_cache_total_blocks", "KV-cache blocks usable by requests.", "gauge"),
    ("swapped_out_total", "num_preemptions_swap",
     "Preemptions that swapped the sequence's KV cache out to host memory (--swap-space).", "counter"),
    ("recomputed_total", "num_preemptions_recompute",
     "Preemptions that dropped the sequence's KV cache, to be recomputed when it resumes.", "counter"),
    ("prompt_tokens_computed_total", "prompt_tokens_computed",
     ("Prompt tokens the model computed: prefix-cache hits and the shared prompt of n>1 requests are "
      "not computed again, recomputation after a preemption is counted again."), "counter"),
    ("prefix_cache_blocks", "prefix_cache_blocks",
     "KV-cache blocks holding a cached prefix, in use or free until reused.", "gauge"),
    ("prefix_cache_evictions_total", "prefix_cache_evictions",
     "Cached prefix blocks dropped from the prefix cache to be reused for other tokens.", "counter"),
    # prefill/decode disaggregation (zero elsewhere)
    ("kv_transfers_total", "kv_transfers",
     "Requests whose KV cache this instance sent to a decode instance (prefill) or received (decode).", "counter"),
    ("kv_transfer_bytes_total", "kv_transfer_bytes", "Bytes of those KV caches.", "counter"),
    ("kv_transfer_seconds_total", "kv_transfer_seconds",
     "Seconds the sends took, each from its start to the decode instance's acknowledgement (prefill).", "counter"),
    ("kv_staging_seconds_total", "kv_transfer_staging_seconds",
     "Seconds spent copying transferred KV blocks between the device and host memory (prefill: out; decode: in).",
     "counter"),
    ("kv_transfer_failures_total", "kv_transfer_failures",
     "KV-cache sends not acknowledged in time (each tried once more elsewhere).", "counter"),
    ("report_age_seconds", "engine_report_age_seconds",
     ("Seconds since the engine core last reported (after every step; every 0.25 s when idle): the age of "
      "the engine figures here. Past --heartbeat-timeout, /health is 503."), "gauge"),
)


# speculative decoding's counters, vLLM's spec_decode names (exported where the engine speculates)
_SPEC_FIGURES = (
    ("spec_drafts_total", "spec_decode_num_drafts",
     "Steps in which a sequence verified draft tokens (speculative decoding)."),
    ("spec_draft_tokens_total", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    ("spec_accepted_tokens_total", "spec_decode_num_accepted_tokens", "Draft tokens the target model accepted."),
)


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    def __init__(self, client: Any, labels: list[str]) -> None:
        self.client = client
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        try:
            figures = self.client.metrics()
        except Exception as exc:  # a dead engine has no figures; the other metrics still matter
            log.debug("engine metrics unavailable: %s", exc)
            return
        for key, name, doc, kind in _ENGINE_FIGURES:
            if key not in figures:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(PREFIX + name, doc,
                                                                                    labels=LABELS)
            family.add_metric(self.labels, float(figures[key]))
            yield family
        per_pos = figures.get("spec_accepted_per_pos")
        if per_pos:  # the engine speculates (--speculative-config)
            for key, name, doc in _SPEC_FIGURES:
                family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
                family.add_metric(self.labels, float(figures[key]))
                yield family
            family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted draft tokens, by their position among a step's drafts (0: the "
                                         "first).", labels=(*LABELS, "position"))
            for position, count in enumerate(per_pos):
                family.add_metric([*self.labels, str(position)], float(count))
            yield family


class ServerMetrics:
    def __init__(self, client: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        values = [model_name, ENGINE_INDEX]
        self.registry.register(_EngineCollector(client, values))
        lengths = token_buckets(int(getattr(client, "max_model_len", 0) or 1))
        own = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several HTTP processes
            own = CollectorRegistry()  # recorded in the folder, shown by the collector below
            MultiProcessCollector(self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            # the labelled child up front, so every series exists (at zero) from the start
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=own).labels(*values)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from a request's arrival to its first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two consecutive tokens of a sequence, one observation per token "
                             "after its first.", _TOKEN_GAP_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A finished request's decode time over its tokens after the first (its longest "
                              "sequence's).", _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Time a request waited in the engine core before it was first scheduled.",
                               _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Time from a request's first scheduling to its first token, in the engine core.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Time from a request's first token to its last.", _REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "A request's prefill time plus its decode time.", _REQUEST_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.", lengths)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Tokens generated for each finished request (all its sequences).",
                                           lengths)
        self.params_n = histogram("request_params_n", "The n parameter of each finished request.", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "The max_tokens of each finished request (the server's default where the client gave none).",
                                           lengths)
        success = Counter(PREFIX + "request_success", "Sequences that finished, by finish reason.",
                          [*LABELS, "finished_reason"], registry=own)
        self.finished = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self._success = success
        self._values = values

    def on_output(self, stream: RequestStream, output: RequestOutput, first_token: bool) -> None:
        """Record an output as it arrives: the request's first token, and every later token."""
        if first_token and stream.first_token_at is not None:
            self.ttft.observe(stream.first_token_at - stream.arrival)
        if output.metrics is not None:
            for gap in output.metrics.inter_token_latencies:
                self.itl.observe(gap)

    def observe(self, stream: RequestStream) -> None:
        """Record a request that finished normally."""
        out = stream.latest
        if out is None or stream.finished_at is None:
            return
        self.e2e.observe(stream.finished_at - stream.arrival)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        self.params_n.observe(stream.params.n)
        if stream.params.max_tokens is not None:  # the offline API's default: none
            self.params_max_tokens.observe(stream.params.max_tokens)
        m = out.metrics
        if m is not None and m.time_in_queue is not None:
            self.queue.observe(m.time_in_queue)
            self.prefill.observe(m.prefill_time)
        if stream.first_token_at is not None:
            decode = stream.finished_at - stream.first_token_at
            self.decode.observe(decode)
            if m is not None and m.prefill_time is not None:
                self.inference.observe(m.prefill_time + decode)
            tokens = max((len(o.token_ids) for o in out.outputs), default=0)
            if tokens > 1:
                self.tpot.observe(decode / (tokens - 1))
        for o in out.outputs:
            reason = o.finish_reason or "unknown"
            counter = self.finished.get(reason)
            if counter is None:
                counter = self.finished[reason] = self._success.labels(*self._values, reason)
            counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
