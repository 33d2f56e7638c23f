"""Prometheus metrics of one worker: its own registry, exposed at /metrics."""

from __future__ import annotations

import re
import threading
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest

from vlserve.sizing.certificates import not_after
from vlserve.sizing.contract import CLIENT_NAME, FRONT_PUBLIC_CERTIFICATE, KERNELS_OWN

# Seconds: from a cached answer (~1 ms) to a long generation on a slow CPU (minutes).
LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5)
# Usage per API client: the names come from the front (the key set's, a bounded list); a worker
# still keeps at most this many labels, whatever reaches it, and counts the rest as "other".
CACHES = ("result", "vision", "prefix")  # the engine's caches, by their `cache` label
MAX_CLIENT_LABELS = 64
NO_CLIENT = "none"  # a request that came with no client name (straight to the worker, or an open front)
OTHER_CLIENTS = "other"


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
        self.cached_prompt_tokens = Counter(
            "vlserve_prompt_tokens_cached",
            "Of the prompt tokens, those whose keys and values came from the prefix cache",
            registry=registry,
        )
        self.prefix_cache_bytes = Gauge(
            "vlserve_prefix_cache_bytes", "Keys and values the prefix cache holds", registry=registry
        )
        self.cancelled = Counter("vlserve_cancelled_requests", "Requests whose client went away", registry=registry)
        self.cache_hits = Counter("vlserve_cache_hits", "Cache hits", ["cache"], registry=registry)
        self.cache_misses = Counter("vlserve_cache_misses", "Cache misses", ["cache"], registry=registry)
        self.resident_memory = Gauge(
            "vlserve_resident_memory_bytes", "Resident memory of this worker", registry=registry
        )
        process = psutil.Process()
        self.resident_memory.set_function(lambda: resident_memory(process))
        self.anonymous_memory = Gauge(
            "vlserve_anonymous_memory_bytes",
            "Resident memory less file-backed pages (the mapped weights)",
            registry=registry,
        )
        self.anonymous_memory.set_function(lambda: anonymous_memory(process))
        self.ready = Gauge("vlserve_ready", "1 once the model is loaded and warmed up", registry=registry)
        self.own_kernels = self._alert_gauges(registry)
        for cache in CACHES:
            self.cache_hits.labels(cache)
            self.cache_misses.labels(cache)
        self.client_requests = Counter(
            "vlserve_client_requests", "Requests per API client and outcome", ["client", "outcome"], registry=registry
        )
        self.client_prompt_tokens = Counter(
            "vlserve_client_prompt_tokens",
            "Prompt tokens per API client (image tokens included)",
            ["client"],
            registry=registry,
        )
        self.client_image_tokens = Counter(
            "vlserve_client_image_tokens",
            "Prompt tokens that stand for images, per API client",
            ["client"],
            registry=registry,
        )
        self.client_completion_tokens = Counter(
            "vlserve_client_completion_tokens", "Completion tokens per API client", ["client"], registry=registry
        )
        self._client_labels: set[str] = set()
        self._client_lock = threading.Lock()

    @staticmethod
    def _alert_gauges(registry: CollectorRegistry) -> Gauge:
        """What the alerts compare with the unit's limits and the host's state: all the memory the
        cgroup is charged (page cache of the weights included, which MemoryHigh counts too) and the
        limits themselves, when the front's certificate ends, and (returned, bound to the engine
        later) whether vlserve's own kernels run."""
        cgroup = own_cgroup()
        for name, file, text in (
            ("vlserve_cgroup_memory_bytes", "memory.current", "Memory charged to this worker's cgroup"),
            ("vlserve_cgroup_memory_high_bytes", "memory.high", "Its MemoryHigh (+Inf: none)"),
            ("vlserve_cgroup_memory_max_bytes", "memory.max", "Its MemoryMax (+Inf: none)"),
        ):
            Gauge(name, text, registry=registry).set_function(lambda file=file: cgroup_value(cgroup, file))
        Gauge(
            "vlserve_certificate_not_after_seconds",
            "When the host front's certificate ends (Unix time; NaN: no such certificate)",
            ["path"],
            registry=registry,
        ).labels(FRONT_PUBLIC_CERTIFICATE).set_function(lambda: certificate_end(FRONT_PUBLIC_CERTIFICATE))
        return Gauge(
            "vlserve_own_kernels", "1 while vlserve's own kernels serve the products, 0 on torch's", registry=registry
        )

    def bind_engine(self, engine: Any) -> None:
        self.ready.set_function(lambda: 1.0 if engine.ready else 0.0)
        self.own_kernels.set_function(lambda: 1.0 if engine.kernels.startswith(KERNELS_OWN) else 0.0)
        self.prefix_cache_bytes.set_function(lambda: engine.prefix_cache.cost)

    def cache_lookup(self, cache: str, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(cache).inc()

    def client_label(self, name: str | None) -> str:
        """The label a client name is counted under: itself while labels stay bounded."""
        if not name:
            return NO_CLIENT
        if not re.match(CLIENT_NAME, name):
            return OTHER_CLIENTS
        with self._client_lock:
            if name not in self._client_labels:
                if len(self._client_labels) >= MAX_CLIENT_LABELS:
                    return OTHER_CLIENTS
                self._client_labels.add(name)
        return name

    def count_usage(self, client: str, usage: Any) -> None:
        """One finished request's tokens, for its client (a label from client_label)."""
        self.client_prompt_tokens.labels(client).inc(usage.prompt_tokens)
        self.client_image_tokens.labels(client).inc(usage.image_tokens)
        self.client_completion_tokens.labels(client).inc(usage.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """The figures the status page shows, since this worker started: latency quantiles estimated
        from the histograms as Prometheus' histogram_quantile does, and the caches' hit ratios."""
        quantiles = {}
        for name, histogram in (
            ("ttft_s", self.ttft_seconds),
            ("tpot_s", self.tpot_seconds),
            ("e2e_s", self.e2e_seconds),
        ):
            buckets = [
                (float(sample.labels["le"]), sample.value)
                for sample in next(iter(histogram.collect())).samples
                if sample.name.endswith("_bucket")
            ]
            quantiles[name] = {"p50": histogram_quantile(0.5, buckets), "p95": histogram_quantile(0.95, buckets)}
        value = self.registry.get_sample_value
        hits = {cache: value("vlserve_cache_hits_total", {"cache": cache}) for cache in CACHES}
        misses = {cache: value("vlserve_cache_misses_total", {"cache": cache}) for cache in CACHES}
        process = psutil.Process()
        return {
            "queue_depth": int(value("vlserve_queue_depth")),
            "running": int(value("vlserve_batch_size")),
            **quantiles,
            "cache_hit_ratio": {
                cache: (hits[cache] / (hits[cache] + misses[cache])) if hits[cache] + misses[cache] else None
                for cache in hits
            },
            "generated_tokens": int(value("vlserve_generated_tokens_total")),
            "resident_memory_bytes": resident_memory(process),
            "anonymous_memory_bytes": anonymous_memory(process),
        }


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, interpolated linearly inside the bucket
    it falls in (Prometheus' rule); None without observations; the last finite bound past it."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def own_cgroup() -> str | None:
    """This process's cgroup directory (cgroup v2), or None."""
    try:
        with open("/proc/self/cgroup") as lines:
            for line in lines:
                if line.startswith("0::"):
                    return "/sys/fs/cgroup" + line[3:].strip()
    except OSError:
        pass
    return None


def cgroup_value(cgroup: str | None, file: str) -> float:
    """A cgroup memory file's bytes: +Inf for "max", NaN where it cannot be read."""
    try:
        with open("%s/%s" % (cgroup, file)) as handle:
            text = handle.read().strip()
    except (OSError, TypeError):
        return float("nan")
    return float("inf") if text == "max" else float(text)


def certificate_end(path: str) -> float:
    try:
        with open(path) as handle:
            end = not_after(handle.read())
    except OSError:
        return float("nan")
    return float("nan") if end is None else float(end)


def resident_memory(process: psutil.Process) -> int:
    """What the memory guard counts: every resident page, the mapped weights' file pages included.

    Those are page cache, but not free to reclaim: the exact level multiplies its weights where they
    lie in the checkpoint's map and the quantized ones in the weight cache's (vlserve/model/packing.py),
    so a page the kernel takes back is read from disk again at the next decode step. The plan's
    MemoryHigh counts them as the worker's own, and the cgroup is charged for them."""
    return process.memory_info().rss


def anonymous_memory(process: psutil.Process) -> int:
    """Resident memory less its file-backed pages: what the worker holds beside its mapped weights."""
    info = process.memory_info()
    return info.rss - info.shared
