"""Prometheus metrics of one worker: its own registry, exposed at /metrics."""

from __future__ import annotations

from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest

# Seconds: from a cached answer (~1 ms) to a long generation on a slow CPU (minutes).
LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        self.requests = Counter(
            "vlserve_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=registry
        )
        self.queue_depth = Gauge("vlserve_queue_depth", "Requests waiting for a batch slot", registry=registry)
        self.batch_size = Gauge("vlserve_batch_size", "Sequences being decoded together", registry=registry)
        self.ttft_seconds = Histogram(
            "vlserve_time_to_first_token_seconds",
            "From submission to the first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot_seconds = Histogram(
            "vlserve_time_per_output_token_seconds",
            "Mean time per token after the first, per request",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.e2e_seconds = Histogram(
            "vlserve_e2e_request_latency_seconds",
            "From submission to the last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "vlserve_prefill_seconds",
            "One prefill forward pass (a group of prompts)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.image_encode_seconds = Histogram(
            "vlserve_image_encode_seconds",
            "Vision encoder time per call (cache misses only)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.decode_batch = Histogram(
            "vlserve_decode_batch_size",
            "Sequences in each decode step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.generated_tokens = Counter("vlserve_generated_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens = Counter("vlserve_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.cancelled = Counter("vlserve_cancelled_requests", "Requests whose client went away", registry=registry)
        self.cache_hits = Counter("vlserve_cache_hits", "Cache hits", ["cache"], registry=registry)
        self.cache_misses = Counter("vlserve_cache_misses", "Cache misses", ["cache"], registry=registry)
        self.resident_memory = Gauge(
            "vlserve_resident_memory_bytes", "Resident memory of this worker", registry=registry
        )
        self.resident_memory.set_function(lambda: psutil.Process().memory_info().rss)
        self.anonymous_memory = Gauge(
            "vlserve_anonymous_memory_bytes",
            "Resident memory less file-backed pages: what the memory guard compares with its limit",
            registry=registry,
        )
        process = psutil.Process()
        self.anonymous_memory.set_function(lambda: anonymous_memory(process))
        self.ready = Gauge("vlserve_ready", "1 once the model is loaded and warmed up", registry=registry)
        for cache in ("result", "vision"):
            self.cache_hits.labels(cache)
            self.cache_misses.labels(cache)

    def bind_engine(self, engine: Any) -> None:
        self.ready.set_function(lambda: 1.0 if engine.ready else 0.0)

    def cache_lookup(self, cache: str, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(cache).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def anonymous_memory(process: psutil.Process) -> int:
    """Resident memory the kernel cannot just drop: RSS less its file-backed pages.

    The memory guard counts this, not RSS: pages of the checkpoint's memory map (held until the prefill
    copies are made, see packing.py) are clean page cache that reclaim takes back for free.
    """
    info = process.memory_info()
    return info.rss - info.shared
