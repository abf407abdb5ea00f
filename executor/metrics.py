"""Engine metrics under vLLM's names (and ours), kept in the scheduler actor so they cover every ingress replica.

Gauges are read from the scheduler's stats at scrape time; counters and histograms are fed by the step loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from executor.outputs import CoreStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
PREFIXES = ("vllm", "pagedserve")


class EngineMetrics:
    """Every metric exists twice, as `vllm:<name>` (so vLLM dashboards work) and `pagedserve:<name>`."""

    def __init__(self, model_name: str, engine_index: int = 0):
        self.registry = CollectorRegistry()
        self._series: dict[tuple, list] = {}
        self.model_name = model_name
        self.engine = str(engine_index)
        labels = ["model_name", "engine"]

        def both(kind: type, name: str, documentation: str, **kwargs: object) -> list:
            return [
                kind(f"{prefix}:{name}", documentation, labels, registry=self.registry, **kwargs) for prefix in PREFIXES
            ]

        self.running = both(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = both(Gauge, "num_requests_waiting", "Requests waiting for KV blocks or a batch slot.")
        self.kv_usage = both(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = both(Counter, "prompt_tokens", "Prompt tokens of requests admitted.")
        self.generation_tokens = both(Counter, "generation_tokens", "Tokens generated.")
        self.preemptions = both(Counter, "num_preemptions", "Recompute preemptions.")
        self.prefix_queries = both(Counter, "prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = both(Counter, "prefix_cache_hits", "Tokens found in the prefix cache.")
        self.draft_tokens = both(Counter, "spec_decode_num_draft_tokens", "Speculative drafts verified.")
        self.accepted_tokens = both(Counter, "spec_decode_num_accepted_tokens", "Speculative drafts accepted.")
        labels = ["model_name", "engine", "finished_reason"]
        self.request_success = both(Counter, "request_success", "Finished requests by finish reason.")
        labels = ["model_name", "engine"]
        self.ttft = both(Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS)
        self.itl = both(Histogram, "inter_token_latency_seconds", "Time between tokens.", buckets=ITL_BUCKETS)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "Arrival to finish.", buckets=REQUEST_BUCKETS)
        self.queue_time = both(
            Histogram, "request_queue_time_seconds", "Arrival to first scheduled.", buckets=REQUEST_BUCKETS
        )
        # Every series exists from the start, so dashboards show 0 rather than "No data".
        for metrics in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries):
            self._labelled(metrics)
        for metrics in (self.prefix_hits, self.draft_tokens, self.accepted_tokens):
            self._labelled(metrics)
        for reason in ("stop", "length", "abort"):
            self._labelled(self.request_success, finished_reason=reason)
        self._seen_preemptions = 0
        self._seen_prefix_queries = 0
        self._seen_prefix_hits = 0
        self._seen_draft_tokens = 0
        self._seen_accepted_tokens = 0

    def _labelled(self, metrics: list, **labels: str) -> list:
        """The labelled series of `metrics` (both prefixes), looked up once: the step loop feeds them per token, and
        prometheus_client's `labels()` validates and hashes its arguments on every call."""
        key = (id(metrics), *labels.items())
        series = self._series.get(key)
        if series is None:
            series = [metric.labels(model_name=self.model_name, engine=self.engine, **labels) for metric in metrics]
            self._series[key] = series
        return series

    def observe(self, metrics: list, value: float) -> None:
        for metric in self._labelled(metrics):
            metric.observe(value)

    def increment(self, metrics: list, amount: float = 1.0, **labels: str) -> None:
        if amount:
            for metric in self._labelled(metrics, **labels):
                metric.inc(amount)

    def total(self, metrics: list) -> float:
        """A counter's value now (read by the periodic stats line, never per step)."""
        name = metrics[0].describe()[0].name
        labels = {"model_name": self.model_name, "engine": self.engine}
        return self.registry.get_sample_value(f"{name}_total", labels) or 0.0

    def update(self, stats: CoreStats) -> None:
        """Gauges now, and the scheduler's cumulative counts turned into counter increments."""
        for metrics, value in (
            (self.running, stats.num_running),
            (self.waiting, stats.num_waiting),
            (self.kv_usage, stats.kv_cache_usage),
        ):
            for metric in self._labelled(metrics):
                metric.set(value)
        self.increment(self.preemptions, stats.num_preemptions - self._seen_preemptions)
        self.increment(self.prefix_queries, stats.prefix_cache_queries - self._seen_prefix_queries)
        self.increment(self.prefix_hits, stats.prefix_cache_hits - self._seen_prefix_hits)
        self.increment(self.draft_tokens, stats.num_draft_tokens - self._seen_draft_tokens)
        self.increment(self.accepted_tokens, stats.num_accepted_draft_tokens - self._seen_accepted_tokens)
        self._seen_preemptions = stats.num_preemptions
        self._seen_prefix_queries = stats.prefix_cache_queries
        self._seen_prefix_hits = stats.prefix_cache_hits
        self._seen_draft_tokens = stats.num_draft_tokens
        self._seen_accepted_tokens = stats.num_accepted_draft_tokens

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
