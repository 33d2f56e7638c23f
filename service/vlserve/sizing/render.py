"""Plans and facts as tables for people, shared by the CLI and the audit; JSON for machines."""

from __future__ import annotations

import json
from typing import Any

from .common import gib
from .cpulist import format_cpu_list


def render_facts(facts: dict[str, Any]) -> str:
    cpu, limits, memory, platform = facts["cpu"], facts["limits"], facts["memory"], facts["platform"]
    isa = ", ".join(name for name, present in cpu["isa"].items() if present) or "none of interest"
    rows = [
        (
            "host",
            "%s (%s, %s)" % (facts["hostname"], platform["os"]["pretty_name"] or "unknown OS", platform["kernel"]),
        ),
        (
            "platform",
            "%s%s%s"
            % (
                platform["kind"],
                " (%s)" % platform["container"] if platform["container"] else "",
                " on %s" % platform["vm"]
                if platform["vm"] and platform["kind"] != "vm"
                else " (%s)" % platform["vm"]
                if platform["vm"]
                else "",
            ),
        ),
        ("cpu", "%s (%s)" % (cpu["model_name"] or "unknown", cpu["arch"])),
        (
            "topology",
            "%d sockets, %d physical cores, %d logical CPUs, %d NUMA nodes"
            % (cpu["sockets"], cpu["physical_cores"], cpu["logical_cpus"], len(cpu["numa_nodes"])),
        ),
        ("e-cores", format_cpu_list(cpu["efficiency_cpus"]) or "none"),
        ("isa", isa),
        ("allowed cpus", format_cpu_list(limits["allowed_cpus"])),
        ("cpu quota", "%.2f CPUs" % limits["cpu_quota"] if limits["cpu_quota"] is not None else "none"),
        ("cgroup", limits["cgroup_version"] or "none"),
        (
            "memory",
            "%s total, %s available, %s swap"
            % (gib(memory["total_bytes"]), gib(memory["available_bytes"]), gib(memory["swap_total_bytes"])),
        ),
        ("memory limit", gib(limits["memory_limit_bytes"]) if limits["memory_limit_bytes"] else "none"),
        ("zram", "available" if memory["zram"]["available"] else "not available"),
        *_balloon_row(memory),
        (
            "cpufreq",
            "%s, governors %s" % (facts["cpufreq"]["driver"], ", ".join(sorted(facts["cpufreq"]["governors"])))
            if facts["cpufreq"]["available"]
            else "not available",
        ),
        ("init", platform["init"]),
    ]
    return _table(rows)


def _balloon_row(memory: dict[str, Any]) -> list[tuple[str, str]]:
    """A row where the host has a virtio memory balloon (facts from before the field have none)."""
    reporting = memory.get("free_page_reporting")
    if reporting is None:
        return []
    if not reporting:
        return [("balloon", "virtio, no free page reporting")]
    return [("balloon", "virtio, reports free pages: the host takes freed memory back (decode speed varies by start)")]


def render_plan(result: dict[str, Any]) -> str:
    memory = result["memory"]
    rows = [
        ("workers", "%d  (%s)" % (result["workers"]["count"], result["workers"]["why"])),
        ("dtype", "%s  (%s)" % (result["model"]["dtype"], result["model"]["why"])),
        ("batch", result["model"]["batch_why"]),
        ("quantize", "%s  (%s)" % (result["model"]["quantize"], result["model"]["quantize_why"])),
        ("weights", result["model"]["packed_why"]),
        ("vision", "%s  (%s)" % (result["model"]["vision_dtype"], result["model"]["vision_why"])),
        ("prefill", "%s  (%s)" % (result["model"]["prefill_dtype"], result["model"]["prefill_why"])),
        ("cores", result["cores"]["why"]),
        ("memory", memory["why"]),
        ("reserve", "%s  (%s)" % (gib(memory["reserve_bytes"]), memory["reserve_why"])),
        ("numa", result["workers"]["numa_why"]),
    ]
    for worker in result["worker_list"]:
        rows.append(
            (
                "worker %d" % worker["index"],
                "port %d, node %d, cpus %s, %d threads, MemoryMax %s"
                % (
                    worker["port"],
                    worker["numa_node"],
                    format_cpu_list(worker["cpus"]),
                    worker["threads"],
                    gib(worker["memory_max_bytes"]),
                ),
            )
        )
    for name, knob in result["knobs"].items():
        value = knob["value"]
        if isinstance(value, dict):
            value = ", ".join("%s=%s" % (k.removesuffix("_bytes"), _knob_value(k, v)) for k, v in value.items())
        rows.append((name, "%s  [%s] %s" % (value, "applies" if knob["applies"] else "n/a", knob["why"])))
    return _table(rows)


def _knob_value(key: str, value: Any) -> str:
    if key.endswith("_bytes"):
        return gib(value)
    if isinstance(value, list):
        return format_cpu_list(value) or "none"
    return str(value)


def _table(rows) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join("%s  %s" % (label.ljust(width), value) for label, value in rows)


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True)
