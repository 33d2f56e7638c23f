"""`vlserve bench-compare`: naive vs tuned on one model, in one run, on this machine.

- naive: what the seeds start from: float32, the processor's default image resolution, one request
  at a time, torch's default threads, no pinning, no caches, plain (unpacked) weights;
- tuned: the sizing plan for this host, started as the deploy role starts it (each worker's
  environment and CPUs), with the service's defaults (capped images, batching, caches).

Workloads, the same requests for both: one client (latency), N concurrent clients (throughput),
a second question about an image already seen (prefix and vision caches), the same request again (result
cache); plus startup to ready from a warm page cache, peak memory, and single-stream decode
against the memory-bandwidth bound. Every figure is a median; the table gives tuned/naive.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from vlserve import sizing
from vlserve.bench.bandwidth import decode_bytes_per_token, measure_read_bandwidth
from vlserve.bench.loadgen import LoadSpec, run_load, single_requests
from vlserve.bench.servers import LocalServer, start_plan_workers, warm_page_cache
from vlserve.bench.workload import Workload
from vlserve.sizing.contract import QUANTIZED_LEVELS

COMPARE_SCHEMA = "vlserve.compare/1"

# The targets for the comparison, as (figure, bound, which way).
TARGETS = {
    "ttft_ratio": (1 / 8, "max"),
    "throughput_ratio": (8.0, "min"),
    "decode_fraction_of_bound": (0.75, "min"),
    "second_question_ttft_ratio": (0.25, "max"),
    "ready_s": (6.0, "max"),
}


@dataclass
class CompareOptions:
    model: Path
    image_size: tuple[int, int] = (1280, 720)
    max_tokens: int = 32
    latency_requests: int = 3
    clients: int = 4
    throughput_requests: int = 8
    cache_pairs: int = 2
    startup_runs: int = 2
    policy: sizing.Policy | None = None
    level_columns: bool = True  # also measure the plan at the other quantize levels (int8, int4)
    progress: bool = True


def processor_default_pixels(model: Path) -> tuple[int, int]:
    """The checkpoint's own (min, max) pixels: what a plain AutoProcessor would use."""
    from vlserve.model.processor import ImageProcessor  # noqa: PLC0415 - torch only here

    size = ImageProcessor.from_directory(model).size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def naive_settings(model: Path) -> dict[str, str]:
    import torch  # noqa: PLC0415

    min_pixels, max_pixels = processor_default_pixels(model)
    return {
        "dtype": "float32",
        "vision_dtype": "float32",
        "prefill_dtype": "float32",
        "threads": str(torch.get_num_threads()),  # torch's default in a fresh process on this machine
        "min_pixels": str(min_pixels),
        "max_pixels": str(max_pixels),
        "max_batch_size": "1",
        "result_cache_entries": "0",
        "vision_cache_bytes": "0",
        "prefix_cache_bytes": "0",
        "packed_weights": "false",
        "quantize": "none",
        "warmup": "false",
    }


# Both: no request times out or is refused while the naive server works through its queue.
COMMON = {"request_timeout_s": "7200", "max_queue": "1024"}


def _say(options: CompareOptions, message: str) -> None:
    if options.progress:
        print("[bench-compare %s] %s" % (time.strftime("%H:%M:%S"), message), file=sys.stderr, flush=True)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class _Config:
    """A named way of starting the service: naive (one process), or a plan's workers (tuned, tuned_int8, ...)."""

    def __init__(self, name: str, options: CompareOptions, plan: dict | None):
        self.name, self.options, self.plan = name, options, plan

    def start(self) -> list[LocalServer]:
        model = self.options.model
        if self.plan is None:
            return [LocalServer(model, naive_settings(model) | COMMON, name="naive").wait_ready().wait_settled()]
        return start_plan_workers(model, self.plan, extra=COMMON)


def measure_config(config: _Config, options: CompareOptions) -> dict:
    startups, settled, peaks = [], [], []
    if config.plan is not None and config.plan["model"]["quantize"] != "none":
        # The first start at a level rounds the weights and writes the weight cache, as the first start
        # after a deploy does; the starts measured below are the later ones, which map it.
        _say(options, "%s: a first start writes the weight cache (not measured)" % config.name)
        for server in config.start():
            server.stop()
    for run in range(options.startup_runs):
        _say(options, "%s: start %d of %d" % (config.name, run + 1, options.startup_runs))
        servers = config.start()
        startups.append(max(s.ready_after_s for s in servers))
        settled.append(max(s.settled_after_s for s in servers))
        if run < options.startup_runs - 1:
            peaks.append(sum(s.peak_rss_bytes for s in servers))
            for server in servers:
                server.stop()
    urls = [s.url for s in servers]
    info = servers[0].info()
    try:
        workload = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=1000)
        _say(options, "%s: latency, 1 client x %d requests" % (config.name, options.latency_requests))
        latency = run_load(
            LoadSpec(
                urls=urls,
                payload=lambda i: workload.payload(i, None),
                requests=options.latency_requests,
                concurrency=1,
                warmup=1,
                progress=False,
            )
        )
        throughput_workload = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=2000)
        _say(
            options,
            "%s: throughput, %d clients x %d requests" % (config.name, options.clients, options.throughput_requests),
        )
        throughput = run_load(
            LoadSpec(
                urls=urls,
                payload=lambda i: throughput_workload.payload(i, None),
                requests=options.throughput_requests,
                concurrency=options.clients,
                warmup=0,
                progress=False,
            )
        )
        _say(options, "%s: second questions and repeated requests, %d pairs each" % (config.name, options.cache_pairs))
        first_ttft, second_ttft, first_e2e, repeat_e2e = [], [], [], []
        for pair in range(options.cache_pairs):
            pictures = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=3000 + pair)
            one, two = single_requests(
                [urls[0]] * 2, [pictures.payload(0, None, question=0), pictures.payload(0, None, question=1)]
            )
            first_ttft.append(one.ttft_s)
            second_ttft.append(two.ttft_s)
            repeated = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=4000 + pair)
            body = repeated.payload(0, None)
            one, two = single_requests([urls[0]] * 2, [body, body])
            first_e2e.append(one.e2e_s)
            repeat_e2e.append(two.e2e_s)
    finally:
        peaks.append(sum(s.peak_rss_bytes for s in servers))
        for server in servers:
            server.stop()
    return {
        "server": {
            k: info.get(k) for k in ("dtype", "vision_dtype", "prefill_dtype", "threads", "packed_weights", "quantize")
        },
        "workers": len(urls),
        "ready_s": _median(startups),
        "ready_runs_s": startups,
        "settled_s": _median(settled),
        "peak_rss_bytes": max(peaks),
        "latency": _strip(latency),
        "throughput": _strip(throughput),
        "second_question": {"first_ttft_s": _median(first_ttft), "second_question_ttft_s": _median(second_ttft)},
        "result_cache": {"first_e2e_s": _median(first_e2e), "repeat_e2e_s": _median(repeat_e2e)},
    }


def _strip(report: dict) -> dict:
    """A load report without its per-request rows."""
    if report["failed"]:
        raise RuntimeError("%d benchmark requests failed: %s" % (report["failed"], report["errors"]))
    return {k: v for k, v in report.items() if k != "results"}


def _figures(naive: dict, tuned: dict, bound: float) -> dict:
    """The targets' figures for one tuned configuration against the naive one."""
    tpot = tuned["latency"]["tpot_s"]["p50"]
    return {
        "ttft_ratio": _ratio(tuned["latency"]["ttft_s"]["p50"], naive["latency"]["ttft_s"]["p50"]),
        "throughput_ratio": _ratio(
            tuned["throughput"]["request_throughput"], naive["throughput"]["request_throughput"]
        ),
        "decode_fraction_of_bound": _ratio(1 / tpot if tpot else None, bound),
        "second_question_ttft_ratio": _ratio(
            tuned["second_question"]["second_question_ttft_s"], tuned["second_question"]["first_ttft_s"]
        ),
        "ready_s": tuned["ready_s"],
    }


def _targets(figures: dict) -> dict:
    verdicts = {}
    for name, (limit, way) in TARGETS.items():
        value = figures[name]
        met = value is not None and (value <= limit if way == "max" else value >= limit)
        verdicts[name] = {"limit": limit, "way": way, "met": met}
    return verdicts


def _plan_summary(plan: dict) -> dict:
    return {
        "workers": plan["workers"]["count"],
        "threads": plan["workers"]["threads"],
        **{
            key: plan["model"][key]
            for key in ("dtype", "max_batch_size", "packed_weights", "vision_dtype", "prefill_dtype", "quantize")
        },
    }


def compare(options: CompareOptions) -> dict:
    facts = sizing.probe()
    policy = options.policy or sizing.Policy()
    plan = sizing.plan(facts, policy)
    configs = {"naive": None, "tuned": plan}
    if options.level_columns:  # the plan at each other quantize level, measured beside it, never instead
        for level in QUANTIZED_LEVELS:
            if level != plan["model"]["quantize"]:
                configs["tuned_" + level] = sizing.plan(facts, replace(policy, quantize=level))
    worker = plan["worker_list"][0]
    _say(options, "plan: %d worker(s), %s" % (plan["workers"]["count"], plan["model"]["dtype"]))

    _say(options, "memory read bandwidth with %d thread(s) on CPUs %s" % (worker["threads"], worker["cpus"]))
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, worker["cpus"])
    try:
        bandwidth = measure_read_bandwidth(worker["threads"], kernels=_kernels())
    finally:
        os.sched_setaffinity(0, mask)
    warm_page_cache(options.model)

    results = {name: measure_config(_Config(name, options, p), options) for name, p in configs.items()}
    naive, tuned = results["naive"], results["tuned"]
    bytes_per_token = decode_bytes_per_token(options.model, tuned["server"]["dtype"], plan["model"]["quantize"])
    bound = bandwidth["bytes_per_s"] / bytes_per_token
    tuned_tpot = tuned["latency"]["tpot_s"]["p50"]
    figures = _figures(naive, tuned, bound)
    result = {
        "schema": COMPARE_SCHEMA,
        "host": facts.get("hostname"),
        "cpu": facts["cpu"].get("model_name"),
        "date": time.strftime("%Y-%m-%d"),
        "model": str(options.model),
        "workload": {
            "image_size": "%dx%d" % options.image_size,
            "max_tokens": options.max_tokens,
            "latency_requests": options.latency_requests,
            "clients": options.clients,
            "throughput_requests": options.throughput_requests,
            "cache_pairs": options.cache_pairs,
            "startup_runs": options.startup_runs,
        },
        "plan": _plan_summary(plan),
        "bandwidth": bandwidth
        | {
            "decode_bytes_per_token": bytes_per_token,
            "decode_bound_tokens_per_s": bound,
            "tuned_decode_tokens_per_s": 1 / tuned_tpot if tuned_tpot else None,
        },
        "naive": naive,
        "tuned": tuned,
        "figures": figures,
        "targets": _targets(figures),
    }
    for name in [name for name in results if name.startswith("tuned_")]:
        level = configs[name]["model"]["quantize"]
        level_bound = bandwidth["bytes_per_s"] / decode_bytes_per_token(
            options.model, results[name]["server"]["dtype"], level
        )
        level_figures = _figures(naive, results[name], level_bound)
        result[name] = results[name] | {
            "plan": _plan_summary(configs[name]),
            "decode_bytes_per_token": decode_bytes_per_token(options.model, results[name]["server"]["dtype"], level),
            "figures": level_figures,
            "targets": _targets(level_figures),
        }
    return result


def render_compare(result: dict) -> str:
    """A Markdown table: figure, naive, tuned, tuned/naive (and each quantize level's pair), target."""
    naive, tuned, targets = result["naive"], result["tuned"], result["targets"]
    levels = {name.removeprefix("tuned_"): result[name] for name in ("tuned_int8", "tuned_int4") if name in result}
    columns = [("tuned", "tuned/naive", tuned)] + [
        ("tuned, %s" % level, "%s/naive" % level, config) for level, config in levels.items()
    ]
    clients = result["workload"]["clients"]

    def row(title, pick, fmt, *, ratio=True, target=""):
        def show(value):
            return "-" if value is None else fmt % value

        cells = [show(pick(naive))]
        for _, _, config in columns:
            value = pick(config)
            relative = _ratio(value, pick(naive)) if ratio else None
            cells += [show(value), "-" if relative is None else "%.3g" % relative]
        return "| %s | %s | %s |" % (title, " | ".join(cells), target)

    def met(name: str) -> str:
        target = targets[name]
        sign = "<=" if target["way"] == "max" else ">="
        said = "%s %.3g: %s" % (sign, target["limit"], "met" if target["met"] else "NOT met")
        if levels:
            said += " (%s)" % ", ".join(
                "%s: %s" % (level, "met" if config["targets"][name]["met"] else "NOT met")
                for level, config in levels.items()
            )
        return said

    def cache_ratio(config):
        return _ratio(config["second_question"]["second_question_ttft_s"], config["second_question"]["first_ttft_s"])

    header = ["figure", "naive"] + [part for name, ratio_name, _ in columns for part in (name, ratio_name)]
    lines = [
        "| %s | target |" % " | ".join(header),
        "|%s---|" % ("---|" * len(header)),
        row(
            "time to first token, 1 client, p50 (s)",
            lambda c: c["latency"]["ttft_s"]["p50"],
            "%.2f",
            target="ratio " + met("ttft_ratio"),
        ),
        row("time per output token, 1 client, p50 (ms)", lambda c: _ms(c["latency"]["tpot_s"]["p50"]), "%.0f"),
        row("end-to-end, 1 client, p50 (s)", lambda c: c["latency"]["e2e_s"]["p50"], "%.2f"),
        row(
            "throughput, %d clients (requests/min)" % clients,
            lambda c: c["throughput"]["request_throughput"] * 60,
            "%.2f",
            target="ratio " + met("throughput_ratio"),
        ),
        row("output tokens/s, %d clients" % clients, lambda c: c["throughput"]["output_throughput"], "%.2f"),
        row("time to first token, %d clients, p50 (s)" % clients, lambda c: c["throughput"]["ttft_s"]["p50"], "%.2f"),
        row(
            "second question about the same image: TTFT / first TTFT",
            cache_ratio,
            "%.2f",
            ratio=False,
            target="tuned " + met("second_question_ttft_ratio"),
        ),
        row("same request again: end-to-end (s)", lambda c: c["result_cache"]["repeat_e2e_s"], "%.3f"),
        row(
            "ready after process start, warm page cache (s)",
            lambda c: c["ready_s"],
            "%.1f",
            target="tuned " + met("ready_s"),
        ),
        row(
            "background work done (prefill and checkpoint copies), after process start (s)",
            lambda c: c["settled_s"],
            "%.1f",
        ),
        row("peak resident memory (GB)", lambda c: c["peak_rss_bytes"] / 1e9, "%.2f"),
        "",
    ]
    lines += _decode_bound_lines(result, levels, met)
    return "\n".join(lines)


def _decode_bound_lines(result: dict, levels: dict, met) -> list[str]:
    """The memory bandwidth, the decode bound it sets, and how near each configuration comes to it."""
    bw, tuned = result["bandwidth"], result["tuned"]
    lines = [
        "Memory read bandwidth: %.1f GB/s (%d threads, %.1f GiB buffer, last-level cache %.0f MiB); a decode step "
        "reads %.2f GB of %s weights, so one stream decodes at most %.2f tokens/s. Tuned single stream: %.2f tokens/s "
        "= %.0f%% of the bound (target %s)."
        % (
            bw["bytes_per_s"] / 1e9,
            bw["threads"],
            bw["buffer_bytes"] / 2**30,
            bw["last_level_cache_bytes"] / 2**20,
            bw["decode_bytes_per_token"] / 1e9,
            tuned["server"]["dtype"],
            bw["decode_bound_tokens_per_s"],
            bw.get("tuned_decode_tokens_per_s") or 0.0,
            100 * (result["figures"]["decode_fraction_of_bound"] or 0.0),
            met("decode_fraction_of_bound"),
        ),
    ]
    for level, config in levels.items():
        tpot = config["latency"]["tpot_s"]["p50"]
        lines.append(
            "tuned, %s: the plan with quantize=%s (vision %s, prompts %s): a decode step reads %.2f GB, "
            "single stream %.2f tokens/s = %.0f%% of its own bound."
            % (
                level,
                level,
                config["plan"]["vision_dtype"],
                config["plan"]["prefill_dtype"],
                config["decode_bytes_per_token"] / 1e9,
                1 / tpot if tpot else 0.0,
                100 * (config["figures"]["decode_fraction_of_bound"] or 0.0),
            )
        )
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is unknown (a model that answered no text has no first-token time)."""
    return None if a is None or not b else a / b


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _kernels():
    """vlserve's kernels as this host's workers load them: the bandwidth reads with them where they run."""
    from vlserve.kernels import native  # noqa: PLC0415 - torch, only when measuring
    from vlserve.settings import ModelSettings  # noqa: PLC0415

    return native.load(ModelSettings().native_kernel_root())
