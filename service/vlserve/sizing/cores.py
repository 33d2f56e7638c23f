"""Cores: which CPUs inference may use, how many workers they allow, and which CPUs each worker gets."""

from __future__ import annotations

from typing import Any

from .common import PlanError
from .cpulist import format_cpu_list
from .policy import Policy, check_policy_fits


def auto_housekeeping(candidate_cores: int) -> int:
    return 0 if candidate_cores < 4 else 1


def split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """Split a list into `parts` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def plan_cores(cpu: dict[str, Any], limits: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """Which physical cores inference may use, per NUMA node, and why."""
    allowed = list(limits["allowed_cpus"])
    if policy.allowed_cpus is not None:
        check_policy_fits(facts_limits=limits, policy=policy)
        allowed = sorted(policy.allowed_cpus)
    efficiency = set(cpu["efficiency_cpus"])
    # One logical CPU per physical core: the lowest allowed sibling. Torch threads on SMT
    # siblings share one core's execution units and slow each other down.
    primary = {}
    for entry in cpu["topology"]:
        if entry["cpu"] in allowed and entry["cpu"] not in efficiency:
            key = tuple(entry["core_cpus"])
            if key not in primary:
                primary[key] = entry
    by_node: dict[int, list[int]] = {}
    for entry in sorted(primary.values(), key=lambda e: e["cpu"]):
        by_node.setdefault(entry["node"], []).append(entry["cpu"])
    candidates = sorted(c for cpus in by_node.values() for c in cpus)
    if not candidates:
        raise PlanError(
            "no usable core: the allowed CPUs (%s) are all efficiency cores or offline"
            % (format_cpu_list(allowed) or "none")
        )

    notes = ["%d physical cores allowed" % len(candidates)]
    if efficiency & set(allowed):
        notes.append("%d E-core CPUs left out" % len(efficiency & set(allowed)))
    reserve = policy.housekeeping_cores
    if reserve is None:
        reserve = auto_housekeeping(len(candidates))
    housekeeping = []
    if reserve:
        for node in sorted(by_node):
            # Keep at least one core per node for inference; the node's first cores do housekeeping
            # (CPU 0 takes most interrupts and timers).
            take = min(reserve, len(by_node[node]) - 1)
            housekeeping += by_node[node][:take]
            by_node[node] = by_node[node][take:]
        notes.append(
            "%d kept for housekeeping (%s)"
            % (
                len(housekeeping),
                "set by policy" if policy.housekeeping_cores is not None else "one per NUMA node from 4 cores up",
            )
        )
    else:
        notes.append(
            "none kept for housekeeping (%s)"
            % ("set by policy" if policy.housekeeping_cores is not None else "fewer than 4 cores")
        )
    quota = limits.get("cpu_quota_cpus")
    usable_count = sum(len(cpus) for cpus in by_node.values())
    if quota is not None and quota < usable_count:
        # The quota caps how many cores can be busy, not which: keep the first cores, spread over nodes.
        order = sorted(((rank, node, c) for node, cpus in by_node.items() for rank, c in enumerate(cpus)))
        keep = {c for _, _, c in order[:quota]}
        by_node = {node: [c for c in cpus if c in keep] for node, cpus in by_node.items()}
        by_node = {node: cpus for node, cpus in by_node.items() if cpus}
        notes.append("CPU quota %.2f caps it at %d" % (limits["cpu_quota"], quota))
    usable = sorted(c for cpus in by_node.values() for c in cpus)

    if policy.objective == "latency":
        count = len(by_node)
        count_why = "latency: one worker per NUMA node"
    else:
        count = sum(max(1, len(cpus) // policy.min_threads_per_worker) for cpus in by_node.values())
        count_why = "throughput: %d usable cores / %d threads per worker at least, per NUMA node" % (
            len(usable),
            policy.min_threads_per_worker,
        )
    return {
        "allowed": allowed,
        "candidates": candidates,
        "housekeeping": sorted(housekeeping),
        "usable": usable,
        "by_node": by_node,
        "count_by_cores": count,
        "count_why": count_why,
        "why": "%d usable: %s" % (len(usable), ", ".join(notes)),
    }


def default_threads(facts: dict[str, Any]) -> int:
    """Torch threads for one process on its own: the physical cores it may use, capped by the CPU quota."""
    allowed = set(facts["limits"]["allowed_cpus"])
    cores = {tuple(e["core_cpus"]) for e in facts["cpu"]["topology"] if e["cpu"] in allowed}
    quota = facts["limits"].get("cpu_quota_cpus")
    return max(1, min(len(cores), quota) if quota else len(cores))


def place_workers(by_node: dict[int, list[int]], policy: Policy, by_memory: int):
    """Give each NUMA node its workers, never one across nodes, and split its cores among them."""
    per_node = {}
    for node, cpus in sorted(by_node.items()):
        if policy.objective == "latency":
            per_node[node] = 1
        else:
            per_node[node] = max(1, len(cpus) // policy.min_threads_per_worker)
    cap = by_memory if policy.max_workers is None else min(by_memory, policy.max_workers)
    # Over the cap: take workers away from the node with the most, so nodes stay balanced; the
    # node's cores go to its remaining workers rather than idling. A node may end with none.
    while sum(per_node.values()) > cap:
        node = max(sorted(per_node), key=lambda n: (per_node[n], -n))
        per_node[node] -= 1
    workers = []
    for node, count in sorted(per_node.items()):
        if count:
            workers += [(node, chunk) for chunk in split_evenly(by_node[node], count)]
    return workers
