"""`/metrics` of the server in the Prometheus text format (prometheus_client, one registry per app).

Counted by the app as requests finish: `stemlm_requests_total{endpoint, finish_reason}` (finish reasons as
in `stemlm.inference.requests`, plus `rejected` for 400 / 429), prompt and generated tokens, and latency
histograms (request duration, time to first token, time between tokens, and each sequence's wait in the queue
for a slot). Read from the engine and the row
cache at each scrape (`EngineCollector`): queue length, active and total slots, decode steps, tokens per
second of decode time, and with host / mmap tables every row cache's lookups, hits, misses and hit rate.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Gauges and counters read from a live `ServedModel` when Prometheus scrapes."""

    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        engine = self.service.engine
        yield GaugeMetricFamily("stemlm_queue_length", "Requests waiting for a slot", value=len(engine.waiting))
        yield GaugeMetricFamily("stemlm_active_slots", "Requests decoding in the batch", value=len(engine.active))
        yield GaugeMetricFamily("stemlm_slots", "KV-pool slots (the most requests decoding at once)", engine.slots)
        yield CounterMetricFamily("stemlm_decode_steps", "Batched decode forwards", value=engine.steps)
        yield GaugeMetricFamily(
            "stemlm_decode_tokens_per_second",
            "Tokens sampled per second of engine step time, since start",
            value=engine.tokens / engine.busy_seconds if engine.busy_seconds else 0.0,
        )
        offloaded = self.service.loaded.offloaded
        if offloaded is None:
            return
        hits = GaugeMetricFamily("stemlm_row_cache_hit_rate", "Hits / distinct ids looked up", labels=["family"])
        counts = {
            name: CounterMetricFamily(f"stemlm_row_cache_{name}", f"Row cache {name}", labels=["family"])
            for name in ("lookups", "hits", "misses", "evictions")
        }
        for family, cache in offloaded.family_caches().items():
            hits.add_metric([family], cache.stats.hit_rate)
            for name, metric in counts.items():
                metric.add_metric([family], getattr(cache.stats, name))
        yield hits
        yield from counts.values()


class Metrics:
    def __init__(self, service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stemlm_requests", "Finished requests", ["endpoint", "finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("stemlm_prompt_tokens", "Prompt tokens admitted", registry=self.registry)
        self.generated_tokens = Counter("stemlm_generated_tokens", "Tokens generated", registry=self.registry)
        self.latency = Histogram(
            "stemlm_request_duration_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.first_token = Histogram(
            "stemlm_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.queue_wait = Histogram(
            "stemlm_queue_wait_seconds",
            "Time a sequence waited for a slot (submitted to admitted), each prompt and choice once",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "stemlm_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.registry.register(EngineCollector(service))

    def render(self) -> bytes:
        return generate_latest(self.registry)
