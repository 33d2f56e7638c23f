"""The load generator behind `vlserve bench`: streams chat completions at a fixed concurrency or a
Poisson request rate against any OpenAI-compatible endpoint and reports what `vllm bench serve`
reports: time to first token, time per output token, inter-token latency, end-to-end latency
(mean, p50, p95, p99), request and token throughput, errors by kind, and the server's peak
resident memory when it runs on this machine.

Knows nothing of torch or of the server's internals; it only speaks HTTP.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx
import psutil

REPORT_SCHEMA = "vlserve.bench/1"


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None  # kind: http_429, http_503, http_4xx, http_5xx, timeout, connection, stream_error
    ttft_s: float | None = None  # to the first chunk that carries text
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def chat_url(base: str) -> str:
    """Accept http://host:port, .../v1 or the full .../v1/chat/completions."""
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + "/v1/chat/completions"


def single_requests(urls: list[str], bodies: list[dict]) -> list[RequestResult]:
    """Streamed requests one after the other (each body to its URL); any failure raises."""
    results = []
    with httpx.Client(timeout=httpx.Timeout(7200.0, connect=10.0)) as client:
        for url, body in zip(urls, bodies, strict=True):
            result = stream_request(client, chat_url(url), body, {})
            if not result.ok:
                raise RuntimeError("a benchmark request failed: %s" % result.error)
            results.append(result)
    return results


def stream_request(client: httpx.Client, url: str, body: dict, headers: dict[str, str]) -> RequestResult:
    """One streamed chat completion, timed from before the request is sent."""
    started = time.perf_counter()
    result = RequestResult(ok=False)
    last_text_at = None
    try:
        with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                code = response.status_code
                result.error = "http_%d" % code if code in (429, 503) else "http_%dxx" % (code // 100)
                return result
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = "stream_error"
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.output_tokens = chunk["usage"].get("completion_tokens") or result.output_tokens
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - started
                        else:
                            result.itl_s.append(now - last_text_at)
                        last_text_at = now
                        if not chunk.get("usage"):
                            result.output_tokens = max(result.output_tokens, len(result.itl_s) + 1)
    except httpx.TimeoutException:
        result.error = "timeout"
        return result
    except httpx.TransportError:
        result.error = "connection"
        return result
    except (ValueError, KeyError):
        result.error = "stream_error"
        return result
    result.e2e_s = time.perf_counter() - started
    result.ok = True
    return result


class MemoryWatch:
    """Samples the resident memory of the server's processes (and their children) in the background."""

    def __init__(self, pids: Iterable[int], interval_s: float = 0.2):
        self.processes = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):  # gone already: nothing to watch
                self.processes.append(psutil.Process(pid))
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def sample(self) -> int:
        total = 0
        for process in self.processes:
            try:
                family = [process, *process.children(recursive=True)]
                total += sum(p.memory_info().rss for p in family)
            except psutil.Error:
                continue
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemoryWatch:
        if self.processes:
            self.sample()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def listening_pids(url: str) -> list[int]:
    """The local processes listening on the URL's port, when the URL is on this machine (else none)."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return []
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return []
    return sorted({c.pid for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid})


@dataclass
class LoadSpec:
    urls: list[str]  # one or more endpoints of the same model; request i goes to urls[i % len(urls)]
    payload: Callable[[int], dict]  # request index -> body
    requests: int | None = 16  # stop after this many (or after duration_s)
    duration_s: float | None = None
    concurrency: int = 1
    rate: float | None = None  # requests per second, Poisson arrivals; None: closed loop at `concurrency`
    warmup: int = 1  # requests sent (one at a time) and discarded before measuring
    api_key: str | None = None
    timeout_s: float = 1800.0
    server_pids: list[int] | None = None  # None: find the local listener on the URL's port
    progress: bool = True
    seed: int = 0


def run_load(spec: LoadSpec) -> dict:
    """Run the load and return the report (schema vlserve.bench/1)."""
    if spec.requests is None and spec.duration_s is None:
        raise ValueError("give a request count or a duration")
    urls = [chat_url(url) for url in spec.urls]
    headers = {"Authorization": "Bearer " + spec.api_key} if spec.api_key else {}
    if spec.server_pids is not None:
        pids = spec.server_pids
    else:
        pids = sorted({pid for url in urls for pid in listening_pids(url)})
    limits = httpx.Limits(max_connections=max(spec.concurrency, 64))
    results: list[RequestResult] = []
    lock = threading.Lock()
    with httpx.Client(timeout=httpx.Timeout(spec.timeout_s, connect=10.0), limits=limits) as client:
        for index in range(spec.warmup):
            for url in urls:
                stream_request(client, url, spec.payload(-1 - index), headers)
        bar = _progress(spec)
        next_index = iter(range(10**9))
        deadline = None if spec.duration_s is None else time.perf_counter() + spec.duration_s

        def more() -> int | None:
            with lock:
                index = next(next_index)
                if spec.requests is not None and index >= spec.requests:
                    return None
                if deadline is not None and time.perf_counter() >= deadline:
                    return None
                return index

        def record(result: RequestResult) -> None:
            with lock:
                results.append(result)
            if bar is not None:
                bar.update(1)

        with MemoryWatch(pids) as memory:
            started = time.perf_counter()
            if spec.rate is None:

                def client_loop() -> None:
                    while (index := more()) is not None:
                        record(stream_request(client, urls[index % len(urls)], spec.payload(index), headers))

                workers = [threading.Thread(target=client_loop) for _ in range(spec.concurrency)]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
            else:
                rng = random.Random(spec.seed)
                with ThreadPoolExecutor(max_workers=max(spec.concurrency, 64)) as pool:
                    arrival = time.perf_counter()
                    while (index := more()) is not None:
                        arrival += rng.expovariate(spec.rate)
                        time.sleep(max(0.0, arrival - time.perf_counter()))
                        pool.submit(
                            lambda i=index: record(
                                stream_request(client, urls[i % len(urls)], spec.payload(i), headers)
                            )
                        )
            elapsed = time.perf_counter() - started
        if bar is not None:
            bar.close()
    return build_report(spec, results, elapsed, memory.peak_bytes if pids else None, pids)


def build_report(
    spec: LoadSpec, results: list[RequestResult], elapsed: float, peak_rss: int | None, pids: list[int]
) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return {
        "schema": REPORT_SCHEMA,
        "urls": [chat_url(url) for url in spec.urls],
        "load": {
            "concurrency": spec.concurrency,
            "rate": spec.rate,
            "requests": spec.requests,
            "duration_s": spec.duration_s,
            "warmup": spec.warmup,
        },
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "elapsed_s": elapsed,
        "request_throughput": len(done) / elapsed if elapsed > 0 else None,
        "output_throughput": output / elapsed if elapsed > 0 else None,
        "total_token_throughput": (output + prompt) / elapsed if elapsed > 0 else None,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "ttft_s": summarize([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_s": summarize([gap for r in done for gap in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in done if r.e2e_s is not None]),
        "server_pids": pids,
        "server_peak_rss_bytes": peak_rss,
        "results": [asdict(r) | {"tpot_s": r.tpot_s} for r in results],
    }


def _progress(spec: LoadSpec):
    if not spec.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # noqa: PLC0415 - a dependency of transformers, present wherever vlserve serves

    return tqdm(total=spec.requests, unit="req", desc="bench", file=sys.stderr)


def render_report(report: dict) -> str:
    """The human-readable table, in `vllm bench serve`'s order."""

    def ms(value: float | None) -> str:
        return "-" if value is None else "%.1f" % (value * 1000)

    def num(value: float | None, fmt: str = "%.3f") -> str:
        return "-" if value is None else fmt % value

    load = report["load"]
    mode = "rate %.3g req/s" % load["rate"] if load["rate"] else "concurrency %d" % load["concurrency"]
    lines = [
        "%-34s %s" % ("endpoint", ", ".join(report["urls"])),
        "%-34s %s" % ("load", mode),
        "%-34s %d" % ("successful requests", report["completed"]),
        "%-34s %d %s" % ("failed requests", report["failed"], report["errors"] or ""),
        "%-34s %.2f" % ("benchmark duration (s)", report["elapsed_s"]),
        "%-34s %d" % ("total input tokens", report["prompt_tokens"]),
        "%-34s %d" % ("total generated tokens", report["output_tokens"]),
        "%-34s %s" % ("request throughput (req/s)", num(report["request_throughput"])),
        "%-34s %s" % ("output token throughput (tok/s)", num(report["output_throughput"], "%.2f")),
        "%-34s %s" % ("total token throughput (tok/s)", num(report["total_token_throughput"], "%.2f")),
    ]
    for key, title in (
        ("ttft_s", "time to first token (ms)"),
        ("tpot_s", "time per output token (ms)"),
        ("itl_s", "inter-token latency (ms)"),
        ("e2e_s", "end-to-end latency (ms)"),
    ):
        stats = report[key]
        lines.append(
            "%-34s mean %s  p50 %s  p95 %s  p99 %s"
            % (title, ms(stats["mean"]), ms(stats["p50"]), ms(stats["p95"]), ms(stats["p99"]))
        )
    peak = report["server_peak_rss_bytes"]
    lines.append(
        "%-34s %s"
        % (
            "server peak RSS",
            "%.2f GB (pids %s)" % (peak / 1e9, ",".join(map(str, report["server_pids"])))
            if peak
            else "not visible (not a local process; pass --server-pid)",
        )
    )
    return "\n".join(lines)
