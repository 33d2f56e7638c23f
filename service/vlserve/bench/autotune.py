"""`vlserve autotune`: where does the plan rank among the configurations this host allows?

Every candidate is a sizing policy (workers x threads per worker, batch size, dtype) planned by the
same planner and started as the deploy role would start it; each runs the same short fixed workload
and is ranked by request throughput. The report gives the plan's throughput as a fraction of the
best, and the best can be written as Ansible host variables that the roles read.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlserve import sizing
from vlserve.bench.loadgen import LoadSpec, run_load
from vlserve.bench.servers import ServerFailed, start_plan_workers, warm_page_cache
from vlserve.bench.workload import Workload

AUTOTUNE_SCHEMA = "vlserve.autotune/1"


@dataclass
class AutotuneOptions:
    model: Path
    image_size: tuple[int, int] = (1280, 720)
    max_tokens: int = 16
    clients: int = 4
    requests: int = 8
    batch_sizes: tuple[int, ...] | None = None  # default: 1 and the plan's
    dtypes: tuple[str, ...] | None = None  # default: float32, and bfloat16 where the CPU has it natively
    levels: tuple[str, ...] | None = None  # quantize levels to sweep; default: the policy's own (its numerics)
    policy: sizing.Policy | None = None
    progress: bool = True


def candidates(facts: dict, base: sizing.Policy, options: AutotuneOptions) -> list[sizing.Policy]:
    """Policies for every split of the plan's usable cores into equal workers, batch size, dtype and
    quantize level (only the policy's own unless `levels` asks for more: rounding changes the answers,
    so a sweep across levels is the operator's call)."""
    planned = sizing.plan(facts, base)
    cores = len(planned["cores"]["usable"])
    batches = options.batch_sizes or tuple(sorted({1, planned["model"]["max_batch_size"]}))
    dtypes = options.dtypes or (("bfloat16", "float32") if sizing.native_bfloat16(facts["cpu"]) else ("float32",))
    levels = options.levels or (base.quantize,)
    policies = []
    for workers in range(1, cores + 1):
        if cores % workers:
            continue
        for batch in batches:
            for dtype in dtypes:
                for level in levels:
                    policies.append(
                        dataclasses.replace(
                            base,
                            objective="throughput",
                            min_threads_per_worker=cores // workers,
                            max_workers=workers,
                            max_batch_size=batch,
                            dtype=dtype,
                            quantize=level,
                        )
                    )
    return policies


def describe(plan: dict) -> str:
    model = plan["model"]
    return "%d worker(s) x %s threads, batch %d, %s%s%s%s" % (
        plan["workers"]["count"],
        "/".join(str(t) for t in sorted(set(plan["workers"]["threads"]))),
        model["max_batch_size"],
        model["dtype"],
        ", packed" if model["packed_weights"] else "",
        ", %s weights" % model["quantize"] if model["quantize"] != "none" else "",
        ", %s prompts" % model["prefill_dtype"]
        if model["prefill_dtype"] not in (model["dtype"], model["quantize"])
        else "",
    )


def plan_key(plan: dict) -> tuple:
    """What makes two plans the same configuration to measure."""
    return (
        tuple(tuple(w["cpus"]) for w in plan["worker_list"]),
        plan["model"]["max_batch_size"],
        plan["model"]["dtype"],
        plan["model"]["packed_weights"],
        plan["model"]["vision_dtype"],
        plan["model"]["prefill_dtype"],
        plan["model"]["quantize"],
    )


def autotune(options: AutotuneOptions) -> dict:
    facts = sizing.probe()
    base = options.policy or sizing.Policy()
    chosen = sizing.plan(facts, base)
    warm_page_cache(options.model)
    workload = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=5000)
    rows, seen = [], {}
    for policy in candidates(facts, base, options):
        try:
            plan = sizing.plan(facts, policy)
        except sizing.PlanError as error:
            rows.append({"config": "%s, quantize %s (%s)" % (policy.dtype, policy.quantize, error), "fits": False})
            continue
        key = plan_key(plan)
        if key in seen:  # two policies that plan the same thing are measured once
            continue
        seen[key] = len(rows)
        label = describe(plan)
        if options.progress:
            print("[autotune %s] %s" % (time.strftime("%H:%M:%S"), label), file=sys.stderr, flush=True)
        try:
            servers = start_plan_workers(options.model, plan, extra={"request_timeout_s": "7200", "max_queue": "1024"})
        except ServerFailed as error:
            rows.append({"config": label, "fits": True, "error": str(error).splitlines()[0]})
            continue
        try:
            report = run_load(
                LoadSpec(
                    urls=[s.url for s in servers],
                    payload=lambda i: workload.payload(i, None),
                    requests=options.requests,
                    concurrency=options.clients,
                    warmup=1,
                    progress=False,
                )
            )
        finally:
            peak = sum(s.peak_rss_bytes for s in servers)
            for server in servers:
                server.stop()
        rows.append(
            {
                "config": label,
                "fits": True,
                "policy": dataclasses.asdict(policy),
                "request_throughput": report["request_throughput"] if not report["failed"] else None,
                "output_throughput": report["output_throughput"],
                "ttft_p50_s": report["ttft_s"]["p50"],
                "failed": report["failed"],
                "peak_rss_bytes": peak,
                "is_plan": key == plan_key(chosen),
            }
        )
    measured = [r for r in rows if r.get("request_throughput")]
    if not measured:
        raise RuntimeError("no candidate configuration could be measured")
    best = max(measured, key=lambda r: r["request_throughput"])
    planned = next((r for r in measured if r.get("is_plan")), None)
    return {
        "schema": AUTOTUNE_SCHEMA,
        "host": facts.get("hostname"),
        "date": time.strftime("%Y-%m-%d"),
        "workload": {
            "image_size": "%dx%d" % options.image_size,
            "max_tokens": options.max_tokens,
            "clients": options.clients,
            "requests": options.requests,
        },
        "plan": describe(chosen),
        "rows": sorted(rows, key=lambda r: -(r.get("request_throughput") or 0)),
        "best": best,
        "plan_fraction_of_best": planned["request_throughput"] / best["request_throughput"] if planned else None,
    }


def render_autotune(result: dict) -> str:
    lines = [
        "| configuration | requests/min | output tokens/s | TTFT p50 (s) | peak RSS (GB) | |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if not row.get("fits"):
            lines.append("| %s | does not fit | | | | |" % row["config"])
        elif row.get("request_throughput") is None:
            lines.append("| %s | failed: %s | | | | |" % (row["config"], row.get("error") or row.get("failed")))
        else:
            lines.append(
                "| %s | %.2f | %.2f | %.2f | %.2f | %s |"
                % (
                    row["config"],
                    row["request_throughput"] * 60,
                    row["output_throughput"],
                    row["ttft_p50_s"],
                    row["peak_rss_bytes"] / 1e9,
                    "plan" if row["is_plan"] else "",
                )
            )
    fraction = result["plan_fraction_of_best"]
    lines.append("")
    lines.append(
        "The plan (%s) reaches %s of the best measured configuration (%s); target at least 95%%."
        % (result["plan"], "-" if fraction is None else "%.0f%%" % (100 * fraction), result["best"]["config"])
    )
    return "\n".join(lines)


def host_override(result: dict) -> str:
    """The best configuration as Ansible host variables for the vlserve_facts role."""
    policy = result["best"]["policy"]
    lines = [
        "---",
        "# Written by `vlserve autotune` on %s, %s: the best of %d measured configurations"
        % (result["host"], result["date"], sum(1 for r in result["rows"] if r.get("request_throughput"))),
        "# (%s, %.2f requests/min on the workload %s)."
        % (result["best"]["config"], result["best"]["request_throughput"] * 60, result["workload"]),
    ]
    # quantize too: the sweep keeps the operator's numerics (quantize=int8 only where they asked for it)
    for name in ("objective", "dtype", "quantize", "min_threads_per_worker", "max_workers", "max_batch_size"):
        lines.append("vlserve_facts_%s: %s" % (name, policy[name]))
    return "\n".join(lines) + "\n"
