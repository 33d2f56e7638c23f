"""Memory: what the host gives the workers, and how one worker fits in it (batch, context, extras)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import GIB, PlanError, gib
from .dtypes import plan_prefill_dtype, plan_vision_dtype
from .footprints import MIN_CONTEXT_TOKENS, ModelFootprint, worker_memory
from .policy import Policy


def plan_memory_budget(memory: dict[str, Any], limits: dict[str, Any], policy: Policy) -> dict[str, Any]:
    total = memory["total_bytes"]
    available = memory["available_bytes"] + (limits.get("vlserve_slice_bytes") or 0)
    why = "MemAvailable"
    if limits.get("vlserve_slice_bytes"):
        why += " plus what vlserve.slice already holds"
    if limits.get("memory_limit_bytes") is not None:
        room = limits["memory_limit_bytes"] - (limits.get("memory_usage_bytes") or 0)
        if room < available:
            available, why = room, "the cgroup memory limit minus its usage"
        total = min(total, limits["memory_limit_bytes"])
    if policy.memory_reserve_bytes is not None:
        reserve, reserve_why = policy.memory_reserve_bytes, "set by policy"
    else:
        reserve, reserve_why = max(GIB, total // 20), "max(1 GiB, 5% of memory)"
    return {
        "total_bytes": total,
        "reserve_bytes": reserve,
        "reserve_why": reserve_why,
        "available_bytes": max(0, available - reserve),
        "available_why": why,
    }


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


def fit_worker(
    footprint: ModelFootprint, dtype: str, cpu: dict[str, Any], policy: Policy, available: int, *, wanted_workers: int
) -> WorkerFit:
    """The largest batch, then context, up to the policy's, with which one worker fits in `available`.

    Three trades of memory for speed: a float32 vision tower, packed weights, a float32 prefill copy.
    Each is taken only where the policy's whole batch and context still fit with it and no worker of
    the `wanted_workers` the cores allow is lost to it (a worker is worth more than a faster phase of
    one); a tight host keeps its batch and its workers instead.
    """
    batch, context = policy.max_batch_size, policy.max_context_tokens
    extras: dict[str, Any] = {}

    def affordable(**extra: Any) -> bool:
        with_it = worker_memory(footprint, dtype, batch, context, **extras, **extra)["high_bytes"]
        without = worker_memory(footprint, dtype, batch, context, **extras)["high_bytes"]
        if with_it > available:
            return False
        return min(wanted_workers, available // with_it) >= min(wanted_workers, available // without)

    vision_dtype, vision_why = plan_vision_dtype(cpu, dtype, policy.quantize)
    if vision_dtype != dtype:
        if affordable(vision_dtype=vision_dtype):
            extras["vision_dtype"] = vision_dtype
        else:
            vision_dtype, vision_why = (
                dtype,
                "as the language model: a %s copy would cost the batch or a worker" % (vision_dtype),
            )
    packed = False
    if dtype != "bfloat16":
        packed_why = "not packed: packing applies to bfloat16 weights only"
    elif affordable(packed=True):
        extras["packed"] = packed = True
        packed_why = "bfloat16: the language model's weights are packed for oneDNN at load (faster decode)"
    else:
        packed_why = "not packed: the packed output head's extra copy would cost the batch or a worker"
    prefill_dtype, prefill_why = plan_prefill_dtype(cpu, dtype, policy.quantize)
    if prefill_dtype != dtype:
        if not packed and prefill_dtype != "int8":  # an int8 copy also serves unpacked (float32) models
            prefill_dtype, prefill_why = (
                dtype,
                "as the language model: the %s prefill copy comes with packing" % (prefill_dtype),
            )
        elif affordable(prefill_dtype=prefill_dtype):
            extras["prefill_dtype"] = prefill_dtype
        else:
            prefill_dtype, prefill_why = (
                dtype,
                "as the language model: a %s copy of its linear layers would cost the batch or a worker"
                % prefill_dtype,
            )
    while True:
        need = worker_memory(footprint, dtype, batch, context, **extras)
        if need["high_bytes"] <= available:
            break
        if batch > 1:
            batch //= 2
        elif context > MIN_CONTEXT_TOKENS:
            context = max(MIN_CONTEXT_TOKENS, context // 2)
        else:
            full = worker_memory(footprint, dtype, policy.max_batch_size, policy.max_context_tokens)
            raise PlanError(
                "one %s worker needs %s in %s (%s with batch 1 and %d-token context), but only %s is "
                "available for workers: add memory (on WSL2 raise memory= in .wslconfig) or stop other "
                "services"
                % (
                    footprint.name,
                    gib(full["high_bytes"]),
                    dtype,
                    gib(need["high_bytes"]),
                    MIN_CONTEXT_TOKENS,
                    gib(available),
                )
            )
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
    )
