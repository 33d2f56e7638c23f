"""The sizing engine: what this host has (`probe`) and how to run the model on it (`plan`).

One source of truth for the playbooks (through the vlserve_facts role, which ships this file to the
target as Ansible module_utils), the audit and the service's CLI. Hence two constraints:
- standard library only at import time: psutil and py-cpuinfo are used when present (the
  controller's venv, a provisioned host) and plain /proc and /sys parsing serves a bare host that
  only has python3;
- one file, no package-relative imports, so Ansible can ship it as it is.

`probe(root)` does all the I/O. `plan(facts, policy)` is a pure function of its arguments: the
same facts and policy always give the same plan, and every figure in it carries a one-line reason.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import socket
import subprocess
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

try:  # Optional: present in the venv, absent on a never-provisioned host.
    import psutil
except ImportError:  # pragma: no cover - exercised on bare targets
    psutil = None

FACTS_SCHEMA = "vlserve.facts/1"
PLAN_SCHEMA = "vlserve.plan/1"
GIB = 1024**3
MIB = 1024**2

# ISA features the planner cares about, by their /proc/cpuinfo names.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


class PlanError(Exception):
    """The host cannot run even one worker under this policy; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# Small parsers shared by the probe.
# --------------------------------------------------------------------------------------------


def parse_cpu_list(text: str | None) -> list[int]:
    """Parse a kernel CPU list ("0-3,8,10-11") into sorted CPU numbers."""
    cpus = set()
    for raw in (text or "").strip().split(","):
        part = raw.strip()
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-", 1)
            cpus.update(range(int(low), int(high) + 1))
        else:
            cpus.add(int(part))
    return sorted(cpus)


def format_cpu_list(cpus) -> str:
    """Format CPU numbers as a kernel/systemd CPU list ("0-3,8")."""
    ranges, run = [], []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            ranges.append(run)
        run = [cpu]
    if run:
        ranges.append(run)
    return ",".join(str(r[0]) if len(r) == 1 else "%d-%d" % (r[0], r[-1]) for r in ranges)


class _Tree:
    """Reads files below a root: "/" for the live host, a captured tree in tests."""

    def __init__(self, root: str):
        self.root = root

    @property
    def live(self) -> bool:
        return os.path.realpath(self.root) == "/"

    def path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        try:
            with open(self.path(path), encoding="utf-8", errors="replace") as handle:
                return handle.read().strip()
        except OSError:
            return None

    def read_int(self, path: str) -> int | None:
        text = self.read(path)
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(self.path(path))

    def glob(self, pattern: str) -> list[str]:
        prefix = self.path("/")
        return sorted("/" + p[len(prefix) :].lstrip("/") for p in glob.glob(self.path(pattern)))


def _cpu_number(path: str) -> int:
    return int(re.search(r"cpu(\d+)", path).group(1))


# --------------------------------------------------------------------------------------------
# Probe: gathers facts. All I/O of the sizing engine lives here.
# --------------------------------------------------------------------------------------------


def probe(root: str = "/", use_libraries: bool = True) -> dict[str, Any]:
    """Gather the facts of the host whose /proc and /sys are below `root`.

    With root "/" and `use_libraries`, psutil and py-cpuinfo are used where installed; the
    `sources` section says which source each group of facts came from.
    """
    tree = _Tree(root)
    libraries = use_libraries and tree.live
    sources: dict[str, str] = {}
    cpu = _probe_cpu(tree, libraries, sources)
    facts = {
        "schema": FACTS_SCHEMA,
        "hostname": socket.gethostname() if tree.live else (tree.read("/etc/hostname") or "unknown"),
        "cpu": cpu,
        "limits": _probe_limits(tree, libraries, cpu, sources),
        "memory": _probe_memory(tree, libraries, sources),
        "cpufreq": _probe_cpufreq(tree),
        "platform": _probe_platform(tree, libraries, cpu, sources),
        "sysctl": {
            "vm.swappiness": tree.read_int("/proc/sys/vm/swappiness"),
            "vm.page-cluster": tree.read_int("/proc/sys/vm/page-cluster"),
        },
        "sources": sources,
    }
    return facts


def _cpuinfo_blocks(tree: _Tree) -> list[dict[str, str]]:
    blocks, block = [], {}
    for line in [*(tree.read("/proc/cpuinfo") or "").splitlines(), ""]:
        if not line.strip():
            if block:
                blocks.append(block)
            block = {}
            continue
        key, _, value = line.partition(":")
        block[key.strip()] = value.strip()
    return blocks


def _probe_cpu(tree: _Tree, libraries: bool, sources: dict[str, str]) -> dict[str, Any]:
    blocks = _cpuinfo_blocks(tree)
    first = blocks[0] if blocks else {}
    flags = set((first.get("flags") or first.get("Features") or "").split())
    model_name = first.get("model name") or first.get("Model") or ""
    vendor = first.get("vendor_id") or first.get("CPU implementer") or ""
    sources["isa"] = "/proc/cpuinfo"
    if libraries:
        try:
            import cpuinfo  # noqa: PLC0415 - py-cpuinfo: optional, and slow to import (it spawns cpuid)

            info = cpuinfo.get_cpu_info()
            model_name = info.get("brand_raw") or model_name
            vendor = info.get("vendor_id_raw") or vendor
            if not flags:  # The kernel's view wins; cpuid flags only where /proc has none.
                flags = set(info.get("flags") or [])
                sources["isa"] = "py-cpuinfo"
            sources["cpu_model"] = "py-cpuinfo"
        except Exception:  # noqa: BLE001 - py-cpuinfo missing or failing: /proc/cpuinfo stands
            sources["cpu_model"] = "/proc/cpuinfo"
    else:
        sources["cpu_model"] = "/proc/cpuinfo"

    online = parse_cpu_list(tree.read("/sys/devices/system/cpu/online"))
    topology = []
    for path in tree.glob("/sys/devices/system/cpu/cpu[0-9]*"):
        number = _cpu_number(path)
        if online and number not in online:
            continue
        siblings = tree.read(path + "/topology/core_cpus_list") or tree.read(path + "/topology/thread_siblings_list")
        max_freq = tree.read_int(path + "/cpufreq/cpuinfo_max_freq")
        topology.append(
            {
                "cpu": number,
                "package": tree.read_int(path + "/topology/physical_package_id") or 0,
                "core_cpus": parse_cpu_list(siblings) or [number],
                "capacity": tree.read_int(path + "/cpu_capacity"),
                "max_freq_khz": max_freq,
            }
        )
    if topology:
        sources["topology"] = "/sys/devices/system/cpu"
    else:  # No sysfs topology (rare: some containers): fall back to /proc/cpuinfo ids.
        sources["topology"] = "/proc/cpuinfo"
        cores: dict[tuple, list[int]] = {}
        for block in blocks:
            if "processor" not in block:
                continue
            key = (block.get("physical id", "0"), block.get("core id", block["processor"]))
            cores.setdefault(key, []).append(int(block["processor"]))
        for (package, _), cpus in cores.items():
            for number in cpus:
                topology.append(
                    {
                        "cpu": number,
                        "package": int(package),
                        "core_cpus": sorted(cpus),
                        "capacity": None,
                        "max_freq_khz": None,
                    }
                )
        topology.sort(key=lambda entry: entry["cpu"])
    if not online:
        online = [entry["cpu"] for entry in topology]

    nodes = {}
    for path in tree.glob("/sys/devices/system/node/node[0-9]*"):
        node_cpus = [c for c in parse_cpu_list(tree.read(path + "/cpulist")) if c in online]
        if node_cpus:
            nodes[str(int(path.rsplit("node", 1)[1]))] = node_cpus
    if not nodes:
        nodes = {"0": list(online)}
    node_of = {cpu: int(node) for node, cpus in nodes.items() for cpu in cpus}
    for entry in topology:
        entry["node"] = node_of.get(entry["cpu"], 0)

    physical = {tuple(entry["core_cpus"]) for entry in topology}
    packages = {entry["package"] for entry in topology}
    return {
        "arch": os.uname().machine if tree.live else (first.get("arch") or "x86_64"),
        "vendor": vendor,
        "model_name": model_name,
        "logical_cpus": len(topology),
        "physical_cores": len(physical),
        "sockets": len(packages),
        "threads_per_core": max((len(core) for core in physical), default=1),
        "numa_nodes": nodes,
        "efficiency_cpus": _efficiency_cpus(tree, topology, sources),
        "isa": {name: name in flags for name in ISA_FLAGS},
        "topology": topology,
    }


def _efficiency_cpus(tree: _Tree, topology: list[dict[str, Any]], sources: dict[str, str]) -> list[int]:
    """E-cores of a hybrid CPU: Intel's cpu_atom PMU list, else a capacity or max-frequency gap."""
    atom = tree.read("/sys/devices/cpu_atom/cpus")
    if atom is not None:
        sources["hybrid"] = "/sys/devices/cpu_atom/cpus"
        return parse_cpu_list(atom)
    for key, threshold, source in (("capacity", 0.8, "cpu_capacity"), ("max_freq_khz", 0.8, "cpuinfo_max_freq gap")):
        values = [entry[key] for entry in topology if entry[key]]
        if len(values) == len(topology) and values and min(values) < threshold * max(values):
            sources["hybrid"] = source
            return sorted(e["cpu"] for e in topology if e[key] < threshold * max(values))
    sources["hybrid"] = "none detected"
    return []


def _own_cgroups(tree: _Tree) -> dict[str, str]:
    """Map controller name -> this process's cgroup path ("" key = the v2 unified path)."""
    paths = {}
    for line in (tree.read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            paths[controller] = parts[2]
    return paths


def _cgroup_version(tree: _Tree) -> str | None:
    if tree.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "v2"
    if tree.exists("/sys/fs/cgroup/cpu") or tree.exists("/sys/fs/cgroup/memory"):
        return "hybrid" if tree.exists("/sys/fs/cgroup/unified") else "v1"
    return None


def _ancestors(path: str) -> list[str]:
    """A cgroup path and its ancestors, innermost first: "/a/b" -> ["/a/b", "/a", "/"]."""
    chain = []
    path = "/" + path.strip("/")
    while True:
        chain.append(path)
        if path == "/":
            return chain
        path = os.path.dirname(path)


def _probe_limits(tree: _Tree, libraries: bool, cpu: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    version = _cgroup_version(tree)
    own = _own_cgroups(tree)
    cpuset: list[int] | None = None
    quota: float | None = None
    memory_limit: int | None = None
    memory_usage: int | None = None

    if version == "v2":
        base = "/sys/fs/cgroup"
        chain = _ancestors(own.get("", "/"))
        cpuset = parse_cpu_list(tree.read(base + chain[0] + "/cpuset.cpus.effective")) or None
        for path in chain:  # The tightest limit on the way up the tree applies.
            max_text = (tree.read(base + path + "/cpu.max") or "max").split()
            if max_text[0] != "max":
                period = int(max_text[1]) if len(max_text) > 1 else 100000
                value = int(max_text[0]) / period
                quota = value if quota is None else min(quota, value)
            mem_text = tree.read(base + path + "/memory.max")
            if mem_text and mem_text != "max":
                memory_limit = int(mem_text) if memory_limit is None else min(memory_limit, int(mem_text))
        memory_usage = tree.read_int(base + chain[0] + "/memory.current")
    elif version in ("v1", "hybrid"):
        for name in ("cpuset.effective_cpus", "cpuset.cpus"):
            text = tree.read("/sys/fs/cgroup/cpuset" + _ancestors(own.get("cpuset", "/"))[0] + "/" + name)
            if text:
                cpuset = parse_cpu_list(text)
                break
        for path in _ancestors(own.get("cpu", "/")):
            q = tree.read_int("/sys/fs/cgroup/cpu" + path + "/cpu.cfs_quota_us")
            p = tree.read_int("/sys/fs/cgroup/cpu" + path + "/cpu.cfs_period_us") or 100000
            if q is not None and q > 0:
                quota = q / p if quota is None else min(quota, q / p)
        for path in _ancestors(own.get("memory", "/")):
            limit = tree.read_int("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes")
            if limit is not None and limit < 2**62:  # v1 says "unlimited" with a huge number
                memory_limit = limit if memory_limit is None else min(memory_limit, limit)
        memory_usage = tree.read_int(
            "/sys/fs/cgroup/memory" + _ancestors(own.get("memory", "/"))[0] + "/memory.usage_in_bytes"
        )

    if libraries and hasattr(os, "sched_getaffinity"):
        affinity = sorted(os.sched_getaffinity(0))
        sources["affinity"] = "sched_getaffinity"
    else:
        status = tree.read("/proc/self/status") or ""
        match = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
        affinity = parse_cpu_list(match.group(1)) if match else [e["cpu"] for e in cpu["topology"]]
        sources["affinity"] = "/proc/self/status"

    online = {entry["cpu"] for entry in cpu["topology"]}
    allowed = online.intersection(affinity).intersection(cpuset if cpuset else online)
    # CPUs our own slice already holds are ours to plan with: once system.slice and user.slice are
    # confined to the housekeeping cores, this probe runs there and would otherwise see only those.
    slice_cpus = None
    if version == "v2" and tree.read("/sys/fs/cgroup/vlserve.slice/cgroup.controllers") is not None:
        slice_cpus = parse_cpu_list(tree.read("/sys/fs/cgroup/vlserve.slice/cpuset.cpus.effective") or "") or None
    allowed = sorted(allowed | online.intersection(slice_cpus or []))
    return {
        "cgroup_version": version,
        "affinity": affinity,
        "cgroup_cpuset": cpuset,
        "allowed_cpus": allowed,
        "cpu_quota": round(quota, 3) if quota is not None else None,
        "cpu_quota_cpus": max(1, math.floor(quota)) if quota is not None else None,
        "memory_limit_bytes": memory_limit,
        "memory_usage_bytes": memory_usage,
        # Memory our own workers already hold: added back so a deployed host plans as a fresh one.
        "vlserve_slice_bytes": tree.read_int("/sys/fs/cgroup/vlserve.slice/memory.current")
        if version == "v2"
        else None,
        "vlserve_slice_cpus": slice_cpus,
    }


def _probe_memory(tree: _Tree, libraries: bool, sources: dict[str, str]) -> dict[str, Any]:
    if libraries and psutil is not None:
        vm, sm = psutil.virtual_memory(), psutil.swap_memory()
        total, available, swap_total = vm.total, vm.available, sm.total
        sources["memory"] = "psutil"
    else:
        info = {}
        for line in (tree.read("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                info[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
        total, swap_total = info.get("MemTotal", 0), info.get("SwapTotal", 0)
        available = info.get("MemAvailable", info.get("MemFree", 0))
        sources["memory"] = "/proc/meminfo"

    swaps = []
    for line in (tree.read("/proc/swaps") or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 5:
            swaps.append(
                {"name": parts[0], "type": parts[1], "size_bytes": int(parts[2]) * 1024, "priority": int(parts[4])}
            )
    zram_devices = []
    for path in tree.glob("/sys/block/zram[0-9]*"):
        algorithm = re.search(r"\[(\w+)\]", tree.read(path + "/comp_algorithm") or "")
        zram_devices.append(
            {
                "name": os.path.basename(path),
                "disksize_bytes": tree.read_int(path + "/disksize"),
                "algorithm": algorithm.group(1) if algorithm else None,
            }
        )
    release = tree.read("/proc/sys/kernel/osrelease") or ""
    zram_module = (
        tree.exists("/sys/module/zram")
        or tree.exists("/sys/class/zram-control")
        or bool(tree.glob("/lib/modules/%s/kernel/drivers/block/zram/zram.ko*" % release))
        or "zram.ko" in (tree.read("/lib/modules/%s/modules.builtin" % release) or "")
    )
    return {
        "total_bytes": total,
        "available_bytes": available,
        "swap_total_bytes": swap_total,
        "swaps": swaps,
        "zram": {"available": zram_module, "devices": zram_devices},
    }


def _probe_cpufreq(tree: _Tree) -> dict[str, Any]:
    governors: dict[str, list[int]] = {}
    epp: dict[str, list[int]] = {}
    available, epp_available, driver = [], [], None
    for path in tree.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq"):
        number = _cpu_number(path)
        governor = tree.read(path + "/scaling_governor")
        if governor:
            governors.setdefault(governor, []).append(number)
        preference = tree.read(path + "/energy_performance_preference")
        if preference:
            epp.setdefault(preference, []).append(number)
        available = available or (tree.read(path + "/scaling_available_governors") or "").split()
        epp_available = epp_available or (tree.read(path + "/energy_performance_available_preferences") or "").split()
        driver = driver or tree.read(path + "/scaling_driver")
    return {
        "available": bool(governors),
        "driver": driver,
        "governors": governors,
        "available_governors": available,
        "energy_performance_preferences": epp,
        "available_energy_performance_preferences": epp_available,
    }


_DMI_VMS = (
    ("qemu", "qemu"),
    ("kvm", "kvm"),
    ("vmware", "vmware"),
    ("virtualbox", "oracle"),
    ("innotek", "oracle"),
    ("xen", "xen"),
    ("amazon ec2", "amazon"),
    ("google", "google"),
    ("microsoft corporation", "microsoft"),
    ("openstack", "kvm"),
    ("bochs", "bochs"),
    ("parallels", "parallels"),
)


def _probe_platform(tree: _Tree, libraries: bool, cpu: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    release = tree.read("/proc/sys/kernel/osrelease") or (os.uname().release if tree.live else "")
    version_text = tree.read("/proc/version") or ""
    wsl = "microsoft" in release.lower() or "microsoft" in version_text.lower()
    wsl_version = None
    if wsl:  # WSL1 kernels say "Microsoft", WSL2 "microsoft-standard-WSL2".
        wsl_version = 2 if ("wsl2" in release.lower() or "microsoft-standard" in release.lower()) else 1

    container = vm = None
    detect = shutil.which("systemd-detect-virt") if libraries else None
    if detect:
        container = _run([detect, "--container"])
        vm = _run([detect, "--vm"])
        sources["virtualization"] = "systemd-detect-virt"
    else:
        sources["virtualization"] = "files"
        container = tree.read("/run/systemd/container")
        if not container:
            if tree.exists("/.dockerenv"):
                container = "docker"
            elif tree.exists("/run/.containerenv"):
                container = "podman"
            elif re.search(r"container=(\w+)", (tree.read("/proc/1/environ") or "").replace("\0", " ")):
                container = re.search(r"container=(\w+)", tree.read("/proc/1/environ").replace("\0", " ")).group(1)
        dmi = " ".join(
            tree.read("/sys/class/dmi/id/" + name) or "" for name in ("sys_vendor", "product_name", "bios_vendor")
        ).lower()
        vm = next((kind for needle, kind in _DMI_VMS if needle in dmi), None)
        if vm is None and tree.read("/sys/hypervisor/type"):
            vm = tree.read("/sys/hypervisor/type")
        if vm is None and wsl:
            vm = "microsoft"
    container = None if container in (None, "", "none") else container
    vm = None if vm in (None, "", "none") else vm
    hypervisor_flag = "hypervisor" in (_cpuinfo_blocks(tree)[:1] or [{}])[0].get("flags", "").split()
    if vm is None and hypervisor_flag:
        vm = "unknown"

    if wsl:
        kind = "wsl"
    elif container:
        kind = "container"
    elif vm:
        kind = "vm"
    else:
        kind = "bare-metal"

    os_release = {}
    for line in (tree.read("/etc/os-release") or "").splitlines():
        key, _, value = line.partition("=")
        os_release[key] = value.strip().strip('"')
    comm = tree.read("/proc/1/comm")
    init = "systemd" if tree.exists("/run/systemd/system") or comm == "systemd" else (comm or "unknown")
    return {
        "kind": kind,
        "container": container,
        "vm": vm,
        "wsl": wsl,
        "wsl_version": wsl_version,
        "kernel": release,
        "init": init,
        "os": {
            "id": os_release.get("ID"),
            "version_id": os_release.get("VERSION_ID"),
            "like": os_release.get("ID_LIKE"),
            "pretty_name": os_release.get("PRETTY_NAME"),
        },
    }


def _run(command: list[str]) -> str | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


# --------------------------------------------------------------------------------------------
# Model footprints: data, with where each figure comes from.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFootprint:
    name: str
    parameters: int
    checkpoint_dtype: str
    text_layers: int
    kv_heads: int
    head_dim: int
    tied_head_parameters: int  # the output head shares the input embedding's weights in the checkpoint
    vision_parameters: int  # the vision tower, which may run in another dtype than the language model
    text_linear_parameters: int  # the text decoder's linear layers, of which prompts may use a float32 copy
    activation_bytes: int
    runtime_bytes: int
    provenance: str


FOOTPRINTS = {
    "qwen3-vl-2b-instruct": ModelFootprint(
        name="Qwen3-VL-2B-Instruct",
        parameters=2_128_000_000,
        checkpoint_dtype="bfloat16",
        text_layers=28,
        kv_heads=8,
        head_dim=128,
        tied_head_parameters=151_936 * 2048,
        vision_parameters=407_000_000,
        text_linear_parameters=28 * (2 * 2048 * 2048 + 2 * 1024 * 2048 + 3 * 2048 * 6144),
        activation_bytes=GIB // 2,
        runtime_bytes=GIB // 2,
        provenance=(
            "parameters and KV shape from the hub config (revision 89644892); bf16 RSS after load "
            "measured at 4.4 GB for 4.26 GB of weights with torch 2.13.0+cpu (shared/MODEL.md), so "
            "0.5 GiB covers the runtime (Python, torch, tokenizer, HTTP); activations: 0.5 GiB "
            "budget for a capped image through the vision tower and a batched prefill, an estimate "
            "until the service measures its peak; in bfloat16 the service packs the output head "
            "into its own copy for oneDNN (vlserve/packing.py), so the tied head counts twice"
        ),
    ),
}

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
COMPUTE_BYTES = DTYPE_BYTES | {"int8": 1}  # the vision tower's and the prefill copy's dtypes may also be int8


# --------------------------------------------------------------------------------------------
# Plan: a pure function of facts and policy.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What the operator asks for. Every field has a safe default; `validate` bounds them."""

    objective: str = field(
        default="throughput",
        metadata={
            "help": "throughput: workers of min_threads_per_worker cores or more; latency: one worker per NUMA node"
        },
    )
    model: str = field(default="qwen3-vl-2b-instruct", metadata={"help": "model footprint to size for"})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (bfloat16 with AVX-512 BF16 or AMX, else float32 if it fits), bfloat16 or float32"},
    )
    quantize: str = field(
        default="none",
        metadata={
            "help": "none, or int8: images and prompts through dynamic int8 products (AVX-512 VNNI or AMX; "
            "faster first token, changed numerics)"
        },
    )
    min_threads_per_worker: int = field(
        default=4, metadata={"help": "throughput objective: the fewest cores a worker gets"}
    )
    max_workers: int | None = field(default=None, metadata={"help": "cap on workers (default: none)"})
    housekeeping_cores: int | None = field(
        default=None,
        metadata={"help": "cores per NUMA node kept for the OS and the front (default: 0 below 4 cores, else 1)"},
    )
    memory_reserve_bytes: int | None = field(
        default=None, metadata={"help": "memory kept for the OS (default: max(1 GiB, 5 percent of memory))"}
    )
    max_batch_size: int = field(default=4, metadata={"help": "sequences a worker decodes together"})
    max_context_tokens: int = field(
        default=4096, metadata={"help": "prompt plus output tokens per sequence, for the KV-cache budget"}
    )
    base_port: int = field(default=8101, metadata={"help": "port of worker 0; worker N listens on base_port + N"})
    allowed_cpus: list[int] | None = field(
        default=None,
        metadata={"help": "restrict inference to these CPUs, a kernel CPU list such as 2-15 (default: all allowed)"},
    )
    swappiness: int | None = field(
        default=None, metadata={"help": "vm.swappiness override (default: 180 when zram is the only swap, else 10)"}
    )
    zram_fraction: float = field(default=0.5, metadata={"help": "zram swap size as a fraction of RAM"})
    zram_max_bytes: int = field(default=8 * GIB, metadata={"help": "upper bound of the zram size"})
    zram_algorithm: str = field(default="zstd", metadata={"help": "zram compression: zstd, lz4, lzo-rle or lzo"})

    def validate(self, name_prefix: str = "") -> Policy:
        """Check every field; the error names each bad field (with `name_prefix`, as the caller calls it)."""
        problems = []

        def bad(name, expected):
            problems.append("%s%s must be %s, not %r" % (name_prefix, name, expected, getattr(self, name)))

        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        if self.objective not in ("throughput", "latency"):
            bad("objective", "throughput or latency")
        if self.model not in FOOTPRINTS:
            bad("model", "one of " + ", ".join(sorted(FOOTPRINTS)))
        if self.dtype not in ("auto", *DTYPE_BYTES):
            bad("dtype", "auto, bfloat16 or float32")
        if self.quantize not in ("none", "int8"):
            bad("quantize", "none or int8")
        for name, low, high in (
            ("min_threads_per_worker", 1, 1024),
            ("max_batch_size", 1, 256),
            ("max_context_tokens", 256, 262144),
            ("base_port", 1024, 65000),
            ("zram_max_bytes", MIB, 2**50),
        ):
            if not is_int(getattr(self, name)) or not low <= getattr(self, name) <= high:
                bad(name, "an integer from %d to %d" % (low, high))
        for name, low in (("max_workers", 1), ("housekeeping_cores", 0), ("memory_reserve_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                bad(name, "empty or an integer >= %d" % low)
        if self.swappiness is not None and (not is_int(self.swappiness) or not 0 <= self.swappiness <= 200):
            bad("swappiness", "empty or an integer from 0 to 200")
        if (
            isinstance(self.zram_fraction, bool)
            or not isinstance(self.zram_fraction, (int, float))
            or not 0 < self.zram_fraction <= 2
        ):
            bad("zram_fraction", "a number above 0 and at most 2")
        if self.zram_algorithm not in ("zstd", "lz4", "lzo-rle", "lzo"):
            bad("zram_algorithm", "zstd, lz4, lzo-rle or lzo")
        if self.allowed_cpus is not None and (
            not isinstance(self.allowed_cpus, list)
            or not self.allowed_cpus
            or not all(is_int(c) and c >= 0 for c in self.allowed_cpus)
        ):
            bad("allowed_cpus", "empty or a non-empty list of CPU numbers")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any], name_prefix: str = "") -> Policy:
        """Build from a mapping (Ansible variables, CLI); unknown keys are an error, None means default."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError("unknown policy fields: %s" % ", ".join(name_prefix + name for name in unknown))
        given = {k: v for k, v in values.items() if v is not None and v != ""}
        hints = typing.get_type_hints(cls)
        for name, value in given.items():  # -e on the command line and env vars arrive as text
            kind = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
            if isinstance(value, str) and kind[0] in (int, float):
                with contextlib.suppress(ValueError):  # validate() names it
                    given[name] = kind[0](value)
        if isinstance(given.get("allowed_cpus"), str):
            try:
                given["allowed_cpus"] = parse_cpu_list(given["allowed_cpus"])
            except ValueError:
                raise ValueError(
                    "%sallowed_cpus must be a CPU list such as 0-3,8, not %r" % (name_prefix, given["allowed_cpus"])
                ) from None
        return cls(**given).validate(name_prefix)


def check_policy_fits(facts_limits: dict[str, Any], policy: Policy, name_prefix: str = "") -> None:
    """Policy values that are valid in general but not on this host (a CPU it does not have)."""
    if policy.allowed_cpus is not None:
        outside = sorted(set(policy.allowed_cpus) - set(facts_limits["allowed_cpus"]))
        if outside:
            raise ValueError(
                "%sallowed_cpus has CPUs %s that this host does not allow (it allows %s)"
                % (name_prefix, format_cpu_list(outside), format_cpu_list(facts_limits["allowed_cpus"]))
            )


def _auto_housekeeping(candidate_cores: int) -> int:
    return 0 if candidate_cores < 4 else 1


def _split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """Split a list into `parts` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _gib(value: float) -> str:
    return "%.1f GiB" % (value / GIB)


MIN_CONTEXT_TOKENS = 2048  # a capped image (~200 tokens), a long question and a long answer
KV_CHUNK_TOKENS = 128  # the service's key/value cache grows by this many tokens at a time (vlserve/kvcache.py)


def worker_memory(
    footprint: ModelFootprint,
    dtype: str,
    batch_size: int,
    context_tokens: int,
    *,
    packed: bool = False,
    vision_dtype: str | None = None,
    prefill_dtype: str | None = None,
) -> dict[str, int]:
    """Per-worker memory: steady state (weights + KV + activations + runtime) and the load peak.

    `packed`: the service's oneDNN-packed bfloat16 weights (vlserve/packing.py), where the tied output
    head gets its own copy. `vision_dtype`: the vision tower's, when it differs from `dtype`.
    `prefill_dtype`: when it differs from `dtype`, a second copy of the text decoder's linear layers
    in that dtype for prompts (vlserve/packing.py).
    """
    width = DTYPE_BYTES[dtype]
    weights = footprint.parameters * width
    if packed:
        weights += footprint.tied_head_parameters * width
    if vision_dtype is not None:
        weights += footprint.vision_parameters * (COMPUTE_BYTES[vision_dtype] - width)
    if prefill_dtype is not None and prefill_dtype != dtype:
        weights += footprint.text_linear_parameters * COMPUTE_BYTES[prefill_dtype]
    kv_tokens = batch_size * (context_tokens + KV_CHUNK_TOKENS)  # each sequence's buffer may hold a chunk spare
    kv_cache = 2 * footprint.text_layers * footprint.kv_heads * footprint.head_dim * width * kv_tokens
    steady = weights + kv_cache + footprint.activation_bytes + footprint.runtime_bytes
    # Loading into another dtype than the checkpoint's holds both copies for a moment
    # (measured: float32 from a bf16 checkpoint peaks at 12.3 GB for 8.3 GB steady).
    peak = weights + footprint.runtime_bytes
    if dtype != footprint.checkpoint_dtype:
        peak += footprint.parameters * DTYPE_BYTES[footprint.checkpoint_dtype]
    high = max(steady, peak)
    return {
        "weights_bytes": weights,
        "kv_cache_bytes": kv_cache,
        "activation_bytes": footprint.activation_bytes,
        "runtime_bytes": footprint.runtime_bytes,
        "steady_bytes": steady,
        "load_peak_bytes": peak,
        # Workers are counted by MemoryHigh (where the kernel throttles and reclaims); MemoryMax
        # (where it kills) sits 10% above, so a burst is slowed, not fatal, and comes out of the reserve.
        "high_bytes": high,
        "max_bytes": int(high * 1.1),
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


def _fit_worker(
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
                    _gib(full["high_bytes"]),
                    dtype,
                    _gib(need["high_bytes"]),
                    MIN_CONTEXT_TOKENS,
                    _gib(available),
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
            _gib(available),
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


def plan(facts: dict[str, Any], policy: Policy | None = None) -> dict[str, Any]:
    """Size the service for a host. Raises PlanError when not even one worker fits."""
    policy = (policy or Policy()).validate()
    if facts.get("schema") != FACTS_SCHEMA:
        raise ValueError("facts schema %r is not %r" % (facts.get("schema"), FACTS_SCHEMA))
    footprint = FOOTPRINTS[policy.model]
    cpu, limits, memory = facts["cpu"], facts["limits"], facts["memory"]

    cores = _plan_cores(cpu, limits, policy)
    budget = _plan_memory_budget(memory, limits, policy)
    dtype, dtype_why = _plan_dtype(cpu, footprint, policy, budget["available_bytes"])
    wanted = cores["count_by_cores"] if policy.max_workers is None else min(cores["count_by_cores"], policy.max_workers)
    fit = _fit_worker(footprint, dtype, cpu, policy, budget["available_bytes"], wanted_workers=wanted)
    per_worker, batch, context = fit.memory, fit.batch, fit.context
    by_memory = budget["available_bytes"] // per_worker["high_bytes"]
    workers = _plan_workers(cores["by_node"], policy, by_memory)
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
                },
            }
        )
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
            "footprint_provenance": footprint.provenance,
        },
        "cores": {key: cores[key] for key in ("allowed", "candidates", "housekeeping", "usable", "why")},
        "memory": dict(
            budget,
            per_worker=per_worker,
            why="MemoryHigh %s per worker (%s steady, %s at load), MemoryMax %s; %s available "
            "for workers"
            % (
                _gib(per_worker["high_bytes"]),
                _gib(per_worker["steady_bytes"]),
                _gib(per_worker["load_peak_bytes"]),
                _gib(per_worker["max_bytes"]),
                _gib(budget["available_bytes"]),
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
        "knobs": _plan_knobs(facts, policy, cores, count * per_worker["high_bytes"] + budget["reserve_bytes"]),
    }


def _plan_cores(cpu: dict[str, Any], limits: dict[str, Any], policy: Policy) -> dict[str, Any]:
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
        reserve = _auto_housekeeping(len(candidates))
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


def _plan_memory_budget(memory: dict[str, Any], limits: dict[str, Any], policy: Policy) -> dict[str, Any]:
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


def native_bfloat16(cpu: dict[str, Any]) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX-512 BF16 or AMX), so bf16 is the faster dtype."""
    return bool(cpu["isa"].get("avx512_bf16") or cpu["isa"].get("amx_bf16"))


def int8_products(cpu: dict[str, Any]) -> bool:
    """Whether int8 matrix products are fast here (AVX-512 VNNI or AMX): ~4x float32's rate measured."""
    return bool(cpu["isa"].get("avx512_vnni") or cpu["isa"].get("amx_int8"))


def _quantized(cpu: dict[str, Any], quantize: str, work: str, otherwise: tuple[str, str]) -> tuple[str, str]:
    """("int8", why) when the policy asks for int8 and this CPU has fast int8 products, else `otherwise`."""
    if quantize != "int8":
        return otherwise
    if not int8_products(cpu):
        return otherwise[0], otherwise[1] + "; quantize=int8 not applied: no AVX-512 VNNI or AMX (int8 would be slower)"
    return "int8", "quantize=int8: %s through dynamic int8 products (AVX-512 VNNI/AMX; numerics change)" % work


def plan_vision_dtype(cpu: dict[str, Any], dtype: str, quantize: str = "none") -> tuple[str, str]:
    """The vision tower's dtype: it runs once per image on hundreds of patches, so it is compute-bound.

    Only AMX makes bfloat16 matrix products faster than float32 ones; with AVX-512 BF16 alone, oneDNN's
    bf16 GEMMs measured 174-190 GFLOP/s against 283 for float32 on a 2-core Sapphire Rapids VM (the
    vision encoder: 3.4 s in bf16, 1.95 s in float32 for a 448x448 image). Decoding is memory-bound
    and stays in `dtype`. With the policy's quantize=int8 and VNNI, int8 (vlserve/quantized.py).
    """
    return _quantized(cpu, quantize, "the vision tower", _vision_dtype(cpu, dtype))


def _vision_dtype(cpu: dict[str, Any], dtype: str) -> tuple[str, str]:
    if dtype == "float32":
        return "float32", "as the language model"
    if cpu["isa"].get("amx_bf16"):
        return "bfloat16", "AMX: bfloat16 matrix products are the fast ones"
    return "float32", (
        "no AMX: float32 matrix products outrun bfloat16 ones, and the encoder is compute-bound "
        "(its float32 copy costs 0.8 GB)"
    )


def plan_prefill_dtype(cpu: dict[str, Any], dtype: str, quantize: str = "none") -> tuple[str, str]:
    """The dtype of the prompt's pass through the text decoder (prefill), which is compute-bound.

    Decoding reads every weight once per token and wants bfloat16's half-size reads; a prompt of a few
    hundred tokens is a matrix product as big as the vision tower's. Without AMX, float32 GEMMs beat
    oneDNN's packed bfloat16 ones from about 48 rows on (0.66-0.72 of the time at 128-256 rows, on a
    2-core Sapphire Rapids VM), so a bfloat16 worker keeps a float32 copy of the decoder's linear
    layers for prompts of 64 tokens or more. With the policy's quantize=int8 and VNNI, an int8 copy.
    """
    return _quantized(cpu, quantize, "prompts", _prefill_dtype(cpu, dtype))


def _prefill_dtype(cpu: dict[str, Any], dtype: str) -> tuple[str, str]:
    if dtype == "float32":
        return "float32", "as the language model"
    if cpu["isa"].get("amx_bf16"):
        return "bfloat16", "AMX: bfloat16 matrix products are the fast ones"
    return "float32", (
        "no AMX: float32 matrix products outrun bfloat16 ones on prompts (a float32 copy of the "
        "decoder's linear layers, 5.6 GB, beside the packed bfloat16 one that decodes)"
    )


def default_threads(facts: dict[str, Any]) -> int:
    """Torch threads for one process on its own: the physical cores it may use, capped by the CPU quota."""
    allowed = set(facts["limits"]["allowed_cpus"])
    cores = {tuple(e["core_cpus"]) for e in facts["cpu"]["topology"] if e["cpu"] in allowed}
    quota = facts["limits"].get("cpu_quota_cpus")
    return max(1, min(len(cores), quota) if quota else len(cores))


def _plan_dtype(cpu: dict[str, Any], footprint: ModelFootprint, policy: Policy, available: int):
    isa = cpu["isa"]
    if policy.dtype != "auto":
        return policy.dtype, "set by policy"
    if native_bfloat16(cpu):
        which = "AMX" if isa.get("amx_bf16") else "AVX-512 BF16"
        return "bfloat16", "the CPU has %s: half the memory traffic per token" % which
    as_float32 = worker_memory(footprint, "float32", policy.max_batch_size, policy.max_context_tokens)
    if as_float32["high_bytes"] <= available:
        return "float32", "no AVX-512 BF16 or AMX: bfloat16 would be emulated"
    return "bfloat16", (
        "no native bfloat16, but a float32 worker needs %s and %s is available: "
        "bfloat16 fits, at emulated speed" % (_gib(as_float32["high_bytes"]), _gib(available))
    )


def _plan_workers(by_node: dict[int, list[int]], policy: Policy, by_memory: int):
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
            workers += [(node, chunk) for chunk in _split_evenly(by_node[node], count)]
    return workers


def _knob(value: Any, applies: bool, why: str, configure: bool | None = None) -> dict[str, Any]:
    """A host knob: the wanted value, whether it takes effect here, whether its config is written anyway."""
    return {"value": value, "applies": applies, "configure": applies if configure is None else configure, "why": why}


def _plan_knobs(facts: dict[str, Any], policy: Policy, cores: dict[str, Any], memory_needed: int) -> dict[str, Any]:
    """Host tuning knobs: the wanted value, whether it applies here, and why.

    `configure` without `applies`: the role writes the persistent config (a container's sysctl.d,
    for when the image boots on a real host) but cannot make it take effect here.
    """
    platform, memory, cpufreq = facts["platform"], facts["memory"], facts["cpufreq"]
    container, wsl = platform["kind"] == "container", bool(platform["wsl"])
    systemd = platform["init"] == "systemd"
    knobs: dict[str, Any] = {}

    if cpufreq["available"] and not container:
        knobs["cpu_governor"] = _knob(
            "performance", True, "steady clocks: ondemand/powersave ramp up too late for bursts"
        )
        has_epp = "performance" in cpufreq["available_energy_performance_preferences"]
        knobs["energy_performance_preference"] = _knob(
            "performance", has_epp, "%s exposes EPP" % cpufreq["driver"] if has_epp else "no EPP on this cpufreq driver"
        )
    else:
        why = (
            "containers cannot set the host's governor"
            if container
            else "no cpufreq here (%s): the hypervisor owns the clocks" % (platform["vm"] or platform["kind"])
        )
        knobs["cpu_governor"] = _knob("performance", False, why)
        knobs["energy_performance_preference"] = _knob("performance", False, why)

    other_swap = [s for s in memory["swaps"] if not os.path.basename(s["name"]).startswith("zram")]
    zram_applies = memory["zram"]["available"] and not container and not wsl and systemd
    if container:
        zram_why = "a container cannot add swap devices"
    elif wsl:
        zram_why = "WSL2's swap is set in .wslconfig, not with zram"
    elif not memory["zram"]["available"]:
        zram_why = "this kernel has no zram module"
    elif not systemd:
        zram_why = "zram swap is set up by systemd units, and this host's init is %s" % platform["init"]
    else:
        zram_why = "compressed swap in RAM absorbs bursts of the housekeeping side; the model never relies on it"
    size = min(int(memory["total_bytes"] * policy.zram_fraction), policy.zram_max_bytes)
    knobs["zram"] = _knob(
        {"size_bytes": size // MIB * MIB, "algorithm": policy.zram_algorithm, "priority": 100}, zram_applies, zram_why
    )

    zram_only = zram_applies and not other_swap
    if policy.swappiness is not None:
        swappiness, swap_why = policy.swappiness, "set by policy"
    elif zram_only:
        swappiness = 180
        swap_why = (
            "zram is the only swap: the kernel docs advise above 100 when swap is faster than the "
            "file system; cold anonymous pages compress instead of evicting the model's page cache"
        )
    elif other_swap:
        swappiness = 10
        swap_why = "swap on a disk: keep anonymous memory (the model's weights) in RAM, reclaim page cache first"
    else:
        swappiness, swap_why = 10, "no swap here: 10 keeps the model's weights resident should a disk swap be added"
    suffix = "; in a container /proc/sys is the host's: written to sysctl.d, not applied" if container else ""
    knobs["swappiness"] = _knob(swappiness, not container, swap_why + suffix, configure=True)
    knobs["page_cluster"] = _knob(
        0 if zram_only else 3,
        not container,
        ("zram swaps single pages fastest: no read-ahead" if zram_only else "the kernel default, for disk swap")
        + suffix,
        configure=True,
    )

    siblings = [
        s
        for e in facts["cpu"]["topology"]
        if e["cpu"] in cores["usable"]
        for s in e["core_cpus"]
        if s != e["cpu"] and s in cores["allowed"]
    ]
    v2 = facts["limits"]["cgroup_version"] == "v2"
    if not (v2 and systemd):
        isolation_why = "needs systemd on cgroup v2 (this host: %s, cgroup %s)" % (
            platform["init"],
            facts["limits"]["cgroup_version"] or "none",
        )
    elif container:
        isolation_why = "a container's cpusets are its host's to set: the slice is written, AllowedCPUs has no effect"
    else:
        isolation_why = "vlserve.slice gets the inference cores through AllowedCPUs="
    nodes = sorted({e["node"] for e in facts["cpu"]["topology"] if e["cpu"] in cores["usable"]})
    knobs["cpu_isolation"] = _knob(
        {
            "slice": "vlserve.slice",
            "cpus": sorted(set(cores["usable"]) | set(siblings)),
            "memory_nodes": nodes,
            "housekeeping_cpus": cores["housekeeping"],
        },
        v2 and systemd and not container,
        isolation_why,
        configure=v2 and systemd,
    )

    knobs["openmp_runtime"] = _knob(
        {"libgomp": True, "numactl": True},
        True,
        "GNU OpenMP for the math libraries that use the system's, numactl to inspect and bind NUMA placement",
    )

    if wsl:
        needed = max(memory_needed, memory["total_bytes"])
        knobs["wsl"] = _knob(
            {"systemd": True, "memory_bytes": -(-needed // GIB) * GIB, "processors": facts["cpu"]["logical_cpus"]},
            True,
            "WSL2 needs systemd=true in /etc/wsl.conf for the units, and .wslconfig memory for the workers",
        )
    else:
        knobs["wsl"] = _knob({"systemd": True}, False, "not a WSL host")
    return knobs


# --------------------------------------------------------------------------------------------
# Human-readable rendering, shared by the CLI and the audit.
# --------------------------------------------------------------------------------------------


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
            % (_gib(memory["total_bytes"]), _gib(memory["available_bytes"]), _gib(memory["swap_total_bytes"])),
        ),
        ("memory limit", _gib(limits["memory_limit_bytes"]) if limits["memory_limit_bytes"] else "none"),
        ("zram", "available" if memory["zram"]["available"] else "not available"),
        (
            "cpufreq",
            "%s, governors %s" % (facts["cpufreq"]["driver"], ", ".join(sorted(facts["cpufreq"]["governors"])))
            if facts["cpufreq"]["available"]
            else "not available",
        ),
        ("init", platform["init"]),
    ]
    return _table(rows)


def render_plan(result: dict[str, Any]) -> str:
    memory = result["memory"]
    rows = [
        ("workers", "%d  (%s)" % (result["workers"]["count"], result["workers"]["why"])),
        ("dtype", "%s  (%s)" % (result["model"]["dtype"], result["model"]["why"])),
        ("batch", result["model"]["batch_why"]),
        ("weights", result["model"]["packed_why"]),
        ("vision", "%s  (%s)" % (result["model"]["vision_dtype"], result["model"]["vision_why"])),
        ("prefill", "%s  (%s)" % (result["model"]["prefill_dtype"], result["model"]["prefill_why"])),
        ("cores", result["cores"]["why"]),
        ("memory", memory["why"]),
        ("reserve", "%s  (%s)" % (_gib(memory["reserve_bytes"]), memory["reserve_why"])),
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
                    _gib(worker["memory_max_bytes"]),
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
        return _gib(value)
    if isinstance(value, list):
        return format_cpu_list(value) or "none"
    return str(value)


def _table(rows) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join("%s  %s" % (label.ljust(width), value) for label, value in rows)


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True)
