"""What a worker really holds against what its plan budgets, level by level: `vlserve bench-footprint`.

For each quantize level, one worker started as this host's plan says (its environment and CPUs), its
resident memory (anonymous and file-backed pages of its mapped weights alike, what its cgroup is
charged) sampled from process start: the load's peak, the settled figure, then the peak while it
serves the plan's batch of image requests at once, and what it holds after them. A first start
comes before, to fill the weight cache where it was empty (rounding holds more, once per release
and host: its peak is recorded apart). The prefix cache is off: its entries are keys and values the
plan budgets as KV cache, and they would stay resident.

The result (schema vlserve.footprint/1, with the facts the plans came from) is what
tests/test_sizing_fixtures.py holds the sizing engine's footprints to: recorded runs live in
tests/fixtures/measured-footprints.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from vlserve import sizing
from vlserve.bench.loadgen import LoadSpec, MemoryWatch, run_load
from vlserve.bench.servers import start_plan_workers, warm_page_cache
from vlserve.bench.workload import Workload

SCHEMA = "vlserve.footprint/1"
# What the plan's figures are compared with: the budget that must hold each measurement.
BUDGETS = (
    ("load_peak_bytes", "load_peak_bytes", "the load's peak"),
    ("settled_bytes", "settled_bytes", "weights and runtime, settled"),
    ("served_bytes", "served_bytes", "weights, runtime and the activations the allocator keeps once it has served"),
    ("high_bytes", "serving_peak_bytes", "the peak while serving a full batch"),
)


@dataclass
class FootprintOptions:
    model: Path
    levels: tuple[str, ...] = sizing.QUANTIZE_LEVELS
    image_size: tuple[int, int] = (1280, 720)
    max_tokens: int = 64
    say: object = print


def budget_of(plan: dict) -> dict[str, int]:
    """The plan's per-worker figures the measurements are held to: `settled_bytes` what a worker holds
    before any request (weights and runtime), `served_bytes` with no request running and no keys and
    values kept, once it has served (the activations too: the allocator keeps them for the next)."""
    memory = plan["memory"]["per_worker"]
    settled = memory["weights_bytes"] + memory["runtime_bytes"]
    return {
        "load_peak_bytes": memory["load_peak_bytes"],
        "settled_bytes": settled,
        "served_bytes": settled + memory["activation_bytes"],
        "high_bytes": memory["high_bytes"],
    }


def measure_level(options: FootprintOptions, facts: dict, level: str) -> dict:
    plan = sizing.plan(facts, sizing.Policy(quantize=level, max_workers=1))
    worker = plan["worker_list"][0]
    batch = plan["model"]["max_batch_size"]
    warm_page_cache(options.model)
    # A first start, not measured against the plan: where the weight cache or the kernels are missing it
    # rounds and builds them (once per release and host), which the starts after it do not.
    (first,) = start_plan_workers(options.model, {"worker_list": [worker]})
    first.stop()
    (server,) = start_plan_workers(options.model, {"worker_list": [worker]}, extra={"prefix_cache_bytes": "0"})
    try:
        pids = [server.process.pid]
        load_peak = server.memory.peak_bytes
        settled = MemoryWatch(pids).sample()
        workload = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=int(time.time()))
        report = run_load(
            LoadSpec(
                urls=[server.url],
                payload=lambda index: workload.payload(index, None),
                requests=2 * batch,
                concurrency=batch,
                warmup=0,
                server_pids=pids,
                progress=False,
            )
        )
        if report["failed"]:
            raise RuntimeError("%d requests failed: %s" % (report["failed"], report["errors"]))
        served = MemoryWatch(pids).sample()
        serving_peak = max(report["server_peak_rss_bytes"], served)
    finally:
        server.stop()
    return {
        "level": level,
        "batch": batch,
        "dtypes": {key: plan["model"][key] for key in ("dtype", "vision_dtype", "prefill_dtype")},
        "first_start": {"ready_s": first.ready_after_s, "peak_bytes": first.memory.peak_bytes},
        "ready_s": server.ready_after_s,
        "settled_s": server.settled_after_s,
        "measured": {
            "load_peak_bytes": load_peak,
            "settled_bytes": settled,
            "served_bytes": served,
            "serving_peak_bytes": serving_peak,
        },
        "plan": budget_of(plan),
    }


def bench_footprint(options: FootprintOptions) -> dict:
    facts = sizing.probe()
    levels = []
    for level in options.levels:
        options.say("%s: one worker as planned, then %s image requests" % (level, "a batch of"))
        levels.append(measure_level(options, facts, level))
    return {
        "schema": SCHEMA,
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "model": str(options.model),
        "image_size": list(options.image_size),
        "max_tokens": options.max_tokens,
        "facts": facts,
        "levels": levels,
    }


def misses(level: dict) -> list[str]:
    """The plan's figures that do not hold what was measured."""
    return [
        "%s: plan %s < measured %s (%s)" % (budget, _gb(level["plan"][budget]), _gb(level["measured"][key]), what)
        for budget, key, what in BUDGETS
        if level["plan"][budget] < level["measured"][key]
    ]


def _gb(value: int) -> str:
    return "%.2f GB" % (value / 1e9)


ROW = "%-5s %-26s %10s %10s %10s %12s"
FIGURES = ("load_peak_bytes", "settled_bytes", "served_bytes", "serving_peak_bytes")


def render(result: dict) -> str:
    lines = [ROW % ("level", "dtypes (rest/vision/prompt)", "load peak", "settled", "served", "serving peak")]
    for level in result["levels"]:
        measured, plan = level["measured"], level["plan"]
        dtypes = "/".join(level["dtypes"][k] for k in ("dtype", "vision_dtype", "prefill_dtype"))
        lines.append(ROW % (level["level"], dtypes, *(_gb(measured[key]) for key in FIGURES)))
        budgets = (*(_gb(plan[key]) for key in FIGURES[:3]), _gb(plan["high_bytes"]) + " hi")
        lines.append(ROW % ("", "  the plan's budget", *budgets))
        lines += ["      MISS " + miss for miss in misses(level)]
    return "\n".join(lines)
