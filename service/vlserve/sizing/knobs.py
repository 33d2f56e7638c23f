"""Host knobs: for each, the wanted value, whether it takes effect here, whether its config is
written anyway, and why. One function per knob; `plan_knobs` collects them in the plan's order.

`configure` without `applies`: the role writes the persistent config (a container's sysctl.d,
for when the image boots on a real host) but cannot make it take effect here.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .common import GIB, MIB
from .policy import Policy


def knob(value: Any, applies: bool, why: str, configure: bool | None = None) -> dict[str, Any]:
    """A host knob: the wanted value, whether it takes effect here, whether its config is written anyway."""
    return {"value": value, "applies": applies, "configure": applies if configure is None else configure, "why": why}


def plan_knobs(facts: dict[str, Any], policy: Policy, cores: dict[str, Any], memory_needed: int) -> dict[str, Any]:
    """Every host knob of the plan; `memory_needed` is what the workers and the reserve take."""
    knobs = cpu_frequency_knobs(facts)
    knobs["zram"] = zram_knob(facts, policy)
    zram_only = knobs["zram"]["applies"] and not _disk_swaps(facts)
    knobs["swappiness"] = swappiness_knob(facts, policy, zram_only)
    knobs["page_cluster"] = page_cluster_knob(facts, zram_only)
    knobs["cpu_isolation"] = cpu_isolation_knob(facts, cores)
    knobs["openmp_runtime"] = knob(
        {"libgomp": True, "numactl": True},
        True,
        "GNU OpenMP for the math libraries that use the system's, numactl to inspect and bind NUMA placement",
    )
    knobs["wsl"] = wsl_knob(facts, memory_needed)
    return knobs


def kernel_version(facts: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) of the running kernel ("5.4.0-150-generic" -> (5, 4)); None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", facts["platform"]["kernel"] or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


# Swappiness above 100 (up to 200) is accepted from Linux 5.8 on; older kernels reject the write.
SWAPPINESS_ABOVE_100_SINCE = (5, 8)
ZRAM_ALGORITHMS = ("zstd", "lz4", "lzo-rle", "lzo")  # in order of preference


def _container(facts: dict[str, Any]) -> bool:
    return facts["platform"]["kind"] == "container"


def _systemd(facts: dict[str, Any]) -> bool:
    return facts["platform"]["init"] == "systemd"


def _disk_swaps(facts: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in facts["memory"]["swaps"] if not os.path.basename(s["name"]).startswith("zram")]


def cpu_frequency_knobs(facts: dict[str, Any]) -> dict[str, Any]:
    """cpu_governor and energy_performance_preference: performance, where cpufreq is ours to set."""
    platform, cpufreq = facts["platform"], facts["cpufreq"]
    listed = cpufreq["available_governors"]
    if cpufreq["available"] and not _container(facts) and listed and "performance" not in listed:
        why = "the %s driver offers no performance governor (it lists %s)" % (cpufreq["driver"], ", ".join(listed))
        return {
            "cpu_governor": knob("performance", False, why),
            "energy_performance_preference": knob("performance", False, why),
        }
    if cpufreq["available"] and not _container(facts):
        has_epp = "performance" in cpufreq["available_energy_performance_preferences"]
        return {
            "cpu_governor": knob("performance", True, "steady clocks: ondemand/powersave ramp up too late for bursts"),
            "energy_performance_preference": knob(
                "performance",
                has_epp,
                "%s exposes EPP" % cpufreq["driver"] if has_epp else "no EPP on this cpufreq driver",
            ),
        }
    why = (
        "containers cannot set the host's governor"
        if _container(facts)
        else "no cpufreq here (%s): the hypervisor owns the clocks" % (platform["vm"] or platform["kind"])
    )
    return {
        "cpu_governor": knob("performance", False, why),
        "energy_performance_preference": knob("performance", False, why),
    }


def zram_knob(facts: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """Compressed swap in RAM, sized from the policy's fraction of memory, where the kernel and init allow."""
    platform, memory = facts["platform"], facts["memory"]
    container, wsl = _container(facts), bool(platform["wsl"])
    applies = memory["zram"]["available"] and not container and not wsl and _systemd(facts)
    if container:
        why = "a container cannot add swap devices"
    elif wsl:
        why = "WSL2's swap is set in .wslconfig, not with zram"
    elif not memory["zram"]["available"]:
        why = "this kernel has no zram module"
    elif not _systemd(facts):
        why = "zram swap is set up by systemd units, and this host's init is %s" % platform["init"]
    else:
        why = "compressed swap in RAM absorbs bursts of the housekeeping side; the model never relies on it"
    algorithm = policy.zram_algorithm
    offered = memory["zram"].get("algorithms")
    if offered and algorithm not in offered:
        fallback = next((name for name in ZRAM_ALGORITHMS if name in offered), None)
        if fallback is None:
            applies, why = (
                False,
                "this kernel's zram offers none of %s (it lists %s)"
                % (
                    ", ".join(ZRAM_ALGORITHMS),
                    ", ".join(offered),
                ),
            )
        else:
            why += "; %s, as this kernel's zram offers no %s" % (fallback, algorithm)
            algorithm = fallback
    size = min(int(memory["total_bytes"] * policy.zram_fraction), policy.zram_max_bytes)
    return knob({"size_bytes": size // MIB * MIB, "algorithm": algorithm, "priority": 100}, applies, why)


def _in_container_suffix(facts: dict[str, Any]) -> str:
    return "; in a container /proc/sys is the host's: written to sysctl.d, not applied" if _container(facts) else ""


def swappiness_knob(facts: dict[str, Any], policy: Policy, zram_only: bool) -> dict[str, Any]:
    """vm.swappiness: above 100 when zram is the only swap (the kernel's advice), else 10."""
    if policy.swappiness is not None:
        value, why = policy.swappiness, "set by policy"
    elif zram_only:
        value = 180
        why = (
            "zram is the only swap: the kernel docs advise above 100 when swap is faster than the "
            "file system; cold anonymous pages compress instead of evicting the model's page cache"
        )
    elif _disk_swaps(facts):
        value = 10
        why = "swap on a disk: keep anonymous memory (the model's weights) in RAM, reclaim page cache first"
    else:
        value, why = 10, "no swap here: 10 keeps the model's weights resident should a disk swap be added"
    version = kernel_version(facts)
    if value > 100 and version is not None and version < SWAPPINESS_ABOVE_100_SINCE:
        value, why = 100, why + "; 100, the most Linux %d.%d accepts (above 100 needs 5.8)" % version
    return knob(value, not _container(facts), why + _in_container_suffix(facts), configure=True)


def page_cluster_knob(facts: dict[str, Any], zram_only: bool) -> dict[str, Any]:
    """vm.page-cluster: no read-ahead for a RAM device, the kernel's default otherwise."""
    why = "zram swaps single pages fastest: no read-ahead" if zram_only else "the kernel default, for disk swap"
    return knob(0 if zram_only else 3, not _container(facts), why + _in_container_suffix(facts), configure=True)


def cpu_isolation_knob(facts: dict[str, Any], cores: dict[str, Any]) -> dict[str, Any]:
    """vlserve.slice with the inference cores (and their SMT siblings) through AllowedCPUs=."""
    platform, limits = facts["platform"], facts["limits"]
    topology = facts["cpu"]["topology"]
    siblings = [
        s
        for e in topology
        if e["cpu"] in cores["usable"]
        for s in e["core_cpus"]
        if s != e["cpu"] and s in cores["allowed"]
    ]
    v2_systemd = limits["cgroup_version"] == "v2" and _systemd(facts)
    if not v2_systemd:
        why = "needs systemd on cgroup v2 (this host: %s, cgroup %s)" % (
            platform["init"],
            limits["cgroup_version"] or "none",
        )
    elif _container(facts):
        why = "a container's cpusets are its host's to set: the slice is written, AllowedCPUs has no effect"
    else:
        why = "vlserve.slice gets the inference cores through AllowedCPUs="
    nodes = sorted({e["node"] for e in topology if e["cpu"] in cores["usable"]})
    return knob(
        {
            "slice": "vlserve.slice",
            "cpus": sorted(set(cores["usable"]) | set(siblings)),
            "memory_nodes": nodes,
            "housekeeping_cpus": cores["housekeeping"],
        },
        v2_systemd and not _container(facts),
        why,
        configure=v2_systemd,
    )


def wsl_knob(facts: dict[str, Any], memory_needed: int) -> dict[str, Any]:
    """WSL2: systemd in /etc/wsl.conf, and .wslconfig memory for the workers."""
    if not facts["platform"]["wsl"]:
        return knob({"systemd": True}, False, "not a WSL host")
    needed = max(memory_needed, facts["memory"]["total_bytes"])
    return knob(
        {"systemd": True, "memory_bytes": -(-needed // GIB) * GIB, "processors": facts["cpu"]["logical_cpus"]},
        True,
        "WSL2 needs systemd=true in /etc/wsl.conf for the units, and .wslconfig memory for the workers",
    )
