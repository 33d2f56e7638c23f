"""The plan: a pure function of the host's facts and the operator's policy.

The same facts and policy always give the same plan, and every figure in it carries a one-line
reason. The steps live in their own modules: cores, memory budget, dtypes, fitting one worker,
placing the workers, then the host's knobs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .common import PLAN_SCHEMA, PlanError, gib
from .contract import QUANTIZE_LEVELS
from .cores import place_workers, plan_cores
from .dtypes import auto_levels, plan_dtype, quantize_checked
from .fitting import WorkerFit, fit_worker, plan_memory_budget
from .footprints import FOOTPRINTS
from .knobs import plan_knobs
from .policy import Policy
from .validate import check_facts


def plan(facts: dict[str, Any], policy: Policy | None = None) -> dict[str, Any]:
    """Size the service for a host. Raises PlanError when not even one worker fits."""
    policy = (policy or Policy()).validate()
    check_facts(facts)
    footprint = FOOTPRINTS[policy.model]
    cpu, limits, memory = facts["cpu"], facts["limits"], facts["memory"]

    cores = plan_cores(cpu, limits, policy)
    budget = plan_memory_budget(memory, limits, policy, facts["platform"])
    wanted = cores["count_by_cores"] if policy.max_workers is None else min(cores["count_by_cores"], policy.max_workers)
    dtype, dtype_why, fit, quantize_why = _fit_at_a_level(footprint, cpu, policy, budget, wanted)
    per_worker, batch, context = fit.memory, fit.batch, fit.context
    by_memory = budget["available_bytes"] // per_worker["high_bytes"]
    workers = place_workers(cores["by_node"], policy, by_memory)
    count = len(workers)
    limits_said = []
    if count < cores["count_by_cores"]:
        limits_said.append("memory allows %d of %d by cores" % (by_memory, cores["count_by_cores"]))
    if policy.max_workers is not None and count == policy.max_workers < min(by_memory, cores["count_by_cores"]):
        limits_said.append("max_workers caps at %d" % policy.max_workers)
    workers_why = "; ".join(limits_said) or "cores allow %d (%s), memory allows %d" % (
        cores["count_by_cores"],
        cores["count_why"],
        by_memory,
    )

    worker_list = _worker_entries(cpu, cores, workers, policy=policy, dtype=dtype, fit=fit)
    multi_node = len(cpu["numa_nodes"]) > 1
    return {
        "schema": PLAN_SCHEMA,
        "host": facts.get("hostname"),
        "policy": asdict(policy),
        "model": {
            "name": footprint.name,
            "dtype": dtype,
            "why": dtype_why,
            "max_batch_size": batch,
            "max_context_tokens": context,
            "batch_why": fit.batch_why,
            "packed_weights": fit.packed,
            "packed_why": fit.packed_why,
            "vision_dtype": fit.vision_dtype,
            "vision_why": fit.vision_why,
            "prefill_dtype": fit.prefill_dtype,
            "prefill_why": fit.prefill_why,
            "quantize": fit.quantize,
            "quantize_why": quantize_why,
            "footprint_provenance": footprint.provenance,
        },
        "cores": {key: cores[key] for key in ("allowed", "candidates", "housekeeping", "usable", "why")},
        "memory": dict(
            budget,
            per_worker=per_worker,
            why="MemoryHigh %s per worker (%s steady, %s at load), MemoryMax %s; %s available "
            "for workers"
            % (
                gib(per_worker["high_bytes"]),
                gib(per_worker["steady_bytes"]),
                gib(per_worker["load_peak_bytes"]),
                gib(per_worker["max_bytes"]),
                gib(budget["available_bytes"]),
            ),
        ),
        "workers": {
            "count": count,
            "threads": [w["threads"] for w in worker_list],
            "why": workers_why,
            "numa_bind": multi_node,
            "numa_why": "each worker is bound to its NUMA node's CPUs and memory"
            if multi_node
            else "one NUMA node: no memory binding needed",
        },
        "worker_list": worker_list,
        "knobs": plan_knobs(facts, policy, cores, count * per_worker["high_bytes"] + budget["reserve_bytes"]),
    }


def _fit_at_a_level(
    footprint, cpu: dict[str, Any], policy: Policy, budget: dict[str, Any], wanted: int
) -> tuple[str, str, WorkerFit, str]:
    """(dtype, why, fit, quantize_why): the policy's level, or on auto the exact weights wherever one
    worker fits and else the widest level that does. A refusal at an explicit level names the level
    that would fit."""
    order, order_why = auto_levels(cpu)
    levels = order if policy.quantize == "auto" else (policy.quantize,)
    refusals: list[str] = []
    for level in levels:
        dtype, dtype_why = plan_dtype(cpu, footprint, policy, budget["available_bytes"], level)
        try:
            fit = fit_worker(footprint, dtype, cpu, policy, budget, wanted_workers=wanted, quantize=level)
        except PlanError as error:
            refusals.append(str(error))
            continue
        checked = quantize_checked(cpu, level)
        if policy.quantize != "auto":
            return dtype, dtype_why, fit, "set by policy" + ("; " + checked if checked else "")
        if level == "none":
            return dtype, dtype_why, fit, "auto: exact weights, one worker fits"
        why = "auto: %s, as the exact weights do not fit (%s); %s" % (level, refusals[0], checked)
        return dtype, dtype_why, fit, why + ("; " + order_why if order_why else "")
    message = refusals[-1]
    if policy.quantize == "auto" and order_why:
        message += "; " + order_why
    if policy.quantize != "auto":
        smaller = QUANTIZE_LEVELS[QUANTIZE_LEVELS.index(policy.quantize) + 1 :]
        for level in [level for level in order if level in smaller]:
            dtype, _ = plan_dtype(cpu, footprint, policy, budget["available_bytes"], level)
            try:
                fit_worker(footprint, dtype, cpu, policy, budget, wanted_workers=wanted, quantize=level)
            except PlanError:
                continue
            message += "; or take quantize: %s, with which one worker fits" % level
            break
    raise PlanError(message)


def _worker_entries(
    cpu: dict[str, Any], cores: dict[str, Any], workers: list, *, policy: Policy, dtype: str, fit: WorkerFit
) -> list[dict[str, Any]]:
    """Each worker's port, CPUs, memory limits and the environment its unit runs it with."""
    per_worker, batch, context = fit.memory, fit.batch, fit.context
    sibling_of = {e["cpu"]: [c for c in e["core_cpus"] if c != e["cpu"]] for e in cpu["topology"]}
    allowed = set(cores["allowed"])
    worker_list = []
    for index, (node, cpus) in enumerate(workers):
        places = ",".join("{%d}" % c for c in cpus)
        worker_list.append(
            {
                "index": index,
                "port": policy.base_port + index,
                "numa_node": node,
                "cpus": cpus,
                # SMT siblings of the worker's cores: the event loop and image decoding may run there,
                # off the cores torch keeps busy; torch threads never do.
                "sibling_cpus": sorted(s for c in cpus for s in sibling_of.get(c, []) if s in allowed),
                "threads": len(cpus),
                "memory_high_bytes": per_worker["high_bytes"],
                "memory_max_bytes": per_worker["max_bytes"],
                "memory_guard_bytes": per_worker["guard_bytes"],
                "environment": {
                    "OMP_NUM_THREADS": str(len(cpus)),
                    "MKL_NUM_THREADS": str(len(cpus)),
                    "OMP_PROC_BIND": "close",
                    "OMP_PLACES": places,
                    "VLSERVE_THREADS": str(len(cpus)),
                    "VLSERVE_DTYPE": dtype,
                    "VLSERVE_MAX_BATCH_SIZE": str(batch),
                    "VLSERVE_MAX_CONTEXT_TOKENS": str(context),
                    "VLSERVE_PACKED_WEIGHTS": "true" if fit.packed else "false",
                    "VLSERVE_VISION_DTYPE": fit.vision_dtype,
                    "VLSERVE_PREFILL_DTYPE": fit.prefill_dtype,
                    "VLSERVE_QUANTIZE": fit.quantize,
                },
            }
        )
    return worker_list
