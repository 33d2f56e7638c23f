"""Memory: what the host gives the workers, and how one worker fits in it (batch, context, extras)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import GIB, PlanError, gib
from .dtypes import is_arm, packed_weights_supported, plan_prefill_dtype, plan_vision_dtype
from .footprints import MIN_CONTEXT_TOKENS, ModelFootprint, worker_memory
from .policy import Policy


def plan_memory_budget(
    memory: dict[str, Any], limits: dict[str, Any], policy: Policy, platform: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the workers may hold: the host's stable capacity minus the reserve and the other services.

    Capacity is total memory, or the cgroup's memory limit where lower (a container), which on WSL2
    is the VM's memory= setting; never what happens to be free at the moment, so a plan holds still
    while the host's other processes grow and shrink (the audit reports those separately).
    """
    capacity, source = memory["total_bytes"], "wsl" if (platform or {}).get("wsl") else "physical"
    why = {"wsl": "the WSL2 VM's memory (memory= in .wslconfig)", "physical": "physical memory"}[source]
    limit = limits.get("memory_limit_bytes")
    if limit is not None and limit < capacity:
        capacity, source, why = limit, "cgroup", "the cgroup's memory limit (memory.max)"
    if policy.memory_reserve_bytes is not None:
        reserve, reserve_why = policy.memory_reserve_bytes, "set by policy"
    else:
        reserve, reserve_why = max(GIB, capacity // 20), "max(1 GiB, 5% of memory)"
    other = policy.other_services_bytes
    if other:
        why += ", less %s the operator declares for other services" % gib(other)
    return {
        "total_bytes": capacity,
        "capacity_source": source,
        "reserve_bytes": reserve,
        "reserve_why": reserve_why,
        "other_services_bytes": other,
        "available_bytes": max(0, capacity - reserve - other),
        "available_why": why,
    }


def capacity_needed(budget: dict[str, Any], policy: Policy, worker_bytes: int) -> int:
    """The capacity at which `worker_bytes` fits: a worker plus the reserve and the other services."""
    base = worker_bytes + budget["other_services_bytes"]
    if policy.memory_reserve_bytes is not None:
        return base + policy.memory_reserve_bytes
    return max(base + GIB, -(-base * 20 // 19))  # the reserve is 5% of the capacity itself


def too_small(
    footprint: ModelFootprint, dtype: str, policy: Policy, budget: dict[str, Any], smallest: int, *, quantize: str
) -> str:
    """Why one worker does not fit, naming the limit that binds and what to change."""
    full = worker_memory(footprint, dtype, policy.max_batch_size, policy.max_context_tokens, quantize=quantize)[
        "high_bytes"
    ]
    needed = capacity_needed(budget, policy, smallest)
    head = "one %s worker needs %s in %s (%s with batch 1 and a %d-token context), but %s leaves %s for workers" % (
        footprint.name,
        gib(full),
        dtype if quantize == "none" else "%s with quantize=%s" % (dtype, quantize),
        gib(smallest),
        MIN_CONTEXT_TOKENS,
        budget["available_why"],
        gib(budget["available_bytes"]),
    )
    remedy = {
        "cgroup": "raise the container's memory limit (memory.max, MemoryMax= or --memory) to at least %s"
        % gib(needed),
        "wsl": "set memory=%dGB under [wsl2] in %%UserProfile%%\\.wslconfig, then run wsl --shutdown"
        % -(-needed // GIB),
        "physical": "this host has %s; it needs at least %s" % (gib(budget["total_bytes"]), gib(needed)),
    }[budget["capacity_source"]]
    if budget["other_services_bytes"]:
        remedy += ", or declare less than %s for other services" % gib(budget["other_services_bytes"])
    if dtype == "float32":
        remedy += ", or take dtype bfloat16 (half the weights' memory, emulated on this CPU)"
    return "%s: %s" % (head, remedy)


@dataclass(frozen=True)
class WorkerFit:
    """What one worker holds and costs: its batch and context, and the memory-for-speed trades it takes."""

    memory: dict[str, int]
    batch: int
    context: int
    batch_why: str
    packed: bool
    packed_why: str
    vision_dtype: str
    vision_why: str
    prefill_dtype: str
    prefill_why: str
    quantize: str


def _shrink_to_fit(
    footprint: ModelFootprint, dtype: str, policy: Policy, budget: dict[str, Any], extras: dict[str, Any]
) -> tuple[dict[str, Any], int, int, str]:
    """The policy's batch halved, then its context, until one worker with `extras` fits the budget:
    (its memory, batch, context, why)."""
    available, quantize = budget["available_bytes"], extras["quantize"]
    batch, context = policy.max_batch_size, policy.max_context_tokens
    while True:
        need = worker_memory(footprint, dtype, batch, context, **extras)
        if need["high_bytes"] <= available:
            break
        if batch > 1:
            batch //= 2
        elif context > MIN_CONTEXT_TOKENS:
            context = max(MIN_CONTEXT_TOKENS, context // 2)
        else:
            raise PlanError(too_small(footprint, dtype, policy, budget, need["high_bytes"], quantize=quantize))
    if (batch, context) == (policy.max_batch_size, policy.max_context_tokens):
        why = "batch %d x %d tokens as the policy asks" % (batch, context)
    else:
        why = "batch %d x %d tokens: the policy's %d x %d does not fit in %s" % (
            batch,
            context,
            policy.max_batch_size,
            policy.max_context_tokens,
            gib(available),
        )
    return need, batch, context, why


def fit_worker(
    footprint: ModelFootprint,
    dtype: str,
    cpu: dict[str, Any],
    policy: Policy,
    budget: dict[str, Any],
    *,
    wanted_workers: int,
    quantize: str = "none",
) -> WorkerFit:
    """The largest batch, then context, up to the policy's, with which one worker fits in `available`.

    Three trades of memory for speed: a float32 vision tower, packed weights, a float32 prefill copy.
    Each is taken only where the policy's whole batch and context still fit with it and no worker of
    the `wanted_workers` the cores allow is lost to it (a worker is worth more than a faster phase of
    one); a tight host keeps its batch and its workers instead.
    """
    available = budget["available_bytes"]
    batch, context = policy.max_batch_size, policy.max_context_tokens
    extras: dict[str, Any] = {"quantize": quantize}

    def affordable(**extra: Any) -> bool:
        with_it = worker_memory(footprint, dtype, batch, context, **extras, **extra)["high_bytes"]
        without = worker_memory(footprint, dtype, batch, context, **extras)["high_bytes"]
        if with_it > available:
            return False
        return min(wanted_workers, available // with_it) >= min(wanted_workers, available // without)

    vision_dtype, vision_why = plan_vision_dtype(cpu, dtype, quantize)
    if vision_dtype != dtype:
        if affordable(vision_dtype=vision_dtype):
            extras["vision_dtype"] = vision_dtype
        else:
            vision_dtype, vision_why = (
                dtype,
                "as the language model: a copy in %s would cost the batch or a worker" % (vision_dtype),
            )
    packed = False
    if quantize != "none":
        packed_why = "quantize=%s: the language model's linear layers in %s, in their kernel's layout" % (
            quantize,
            quantize,
        )
    elif dtype != "bfloat16":
        packed_why = "not packed: packing applies to bfloat16 weights only"
    elif is_arm(cpu):
        packed_why = "not packed: the packed kernels are oneDNN's x86 ones; %s decodes from plain weights" % cpu["arch"]
    elif not packed_weights_supported(cpu):
        packed_why = "not packed: oneDNN's packed bfloat16 needs AVX-512 BF16 or AMX; plain bfloat16 weights"
    elif affordable(packed=True):
        extras["packed"] = packed = True
        packed_why = "bfloat16: the language model's weights are packed for oneDNN at load (faster decode)"
    else:
        packed_why = "not packed: the packed output head's extra copy would cost the batch or a worker"
    prefill_dtype, prefill_why = plan_prefill_dtype(cpu, dtype, quantize)
    # A copy needs the service's own linear layers: packed, or plain bfloat16 on x86 (vlserve/model/packing.py);
    # an int8 one also serves unpacked float32 models.
    copies_possible = packed or (dtype == "bfloat16" and not is_arm(cpu)) or prefill_dtype == "int8"
    if prefill_dtype not in (dtype, quantize):
        if not copies_possible:
            prefill_dtype, prefill_why = (
                dtype,
                "as the language model: the %s prefill copy comes with packing" % (prefill_dtype),
            )
        elif affordable(prefill_dtype=prefill_dtype):
            extras["prefill_dtype"] = prefill_dtype
        else:
            prefill_dtype, prefill_why = (
                dtype if quantize == "none" else quantize,
                "as the language model: a copy of its linear layers in %s would cost the batch or a worker"
                % prefill_dtype,
            )
    need, batch, context, why = _shrink_to_fit(footprint, dtype, policy, budget, extras)
    return WorkerFit(
        memory=need,
        batch=batch,
        context=context,
        batch_why=why,
        packed=packed,
        packed_why=packed_why,
        vision_dtype=vision_dtype,
        vision_why=vision_why,
        prefill_dtype=prefill_dtype,
        prefill_why=prefill_why,
        quantize=quantize,
    )
