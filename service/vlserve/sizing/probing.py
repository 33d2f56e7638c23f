"""The probe: what this host has. All I/O of the sizing engine lives here.

`probe(root)` reads /proc and /sys below `root` ("/" for the live host, a captured tree in tests);
psutil and py-cpuinfo are used where installed, plain file parsing serves a bare host that only
has python3. The `sources` section of the facts says where each group came from.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import socket
import subprocess
from typing import Any

from .common import FACTS_SCHEMA
from .cpulist import parse_cpu_list

try:  # Optional: present in the venv, absent on a never-provisioned host.
    import psutil
except ImportError:  # pragma: no cover - exercised on bare targets
    psutil = None

try:  # The CPUs this process started on (see vlserve/__init__.py); absent where this package runs on
    # its own, as the facts role's module_utils, in a process that never loads an OpenMP runtime.
    from vlserve import LAUNCH_AFFINITY
except ImportError:  # pragma: no cover - exercised by the facts role on its targets
    LAUNCH_AFFINITY = None

# ISA features the planner cares about, by their /proc/cpuinfo names: x86 flags, then aarch64
# Features (dot product, BF16, int8 matrix multiply, SVE).
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
    "asimddp",
    "bf16",
    "i8mm",
    "sve",
)


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
    if tree.live and _held_to_avx2(flags):
        # torch in this process will not run what lies above AVX2: a plan counting on it would be wrong.
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
        sources["isa"] += ", held to AVX2 by ATEN_CPU_CAPABILITY"

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


def _held_to_avx2(flags: set[str]) -> bool:
    """ATEN_CPU_CAPABILITY=avx2 (how an AVX2 host is imitated, or an operator's choice) on a CPU with more."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" and any(
        f.startswith(("avx512", "amx")) for f in flags
    )


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

    if tree.live and LAUNCH_AFFINITY is not None:
        # Not this thread's mask now: an OpenMP runtime may have bound it to one place since.
        affinity = sorted(LAUNCH_AFFINITY)
        sources["affinity"] = "sched_getaffinity at start"
    elif libraries and hasattr(os, "sched_getaffinity"):
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
    zram_devices, algorithms = [], None
    for path in tree.glob("/sys/block/zram[0-9]*"):
        listed = tree.read(path + "/comp_algorithm") or ""  # "lzo lzo-rle lz4 [zstd]": the kernel's choices
        algorithm = re.search(r"\[([\w-]+)\]", listed)
        algorithms = algorithms or sorted(word.strip("[]") for word in listed.split()) or None
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
        "zram": {"available": zram_module, "devices": zram_devices, "algorithms": algorithms},
        "free_page_reporting": _free_page_reporting(tree),
    }


VIRTIO_BALLOON = "0x0005"  # virtio device id of the memory balloon
BALLOON_REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING in the device's feature bits


def _free_page_reporting(tree: _Tree) -> bool | None:
    """Whether a virtio memory balloon reports the guest's free pages to the host, which takes them
    back (None: no balloon). Memory a worker frees then returns slowly and may come back as other
    physical pages: on such a VM a 2 GiB buffer took 2.6-3.3 s to fill once its memory had been free
    for 20 s against 0.2 s right after, and decode speed moved with the pages the weights landed in.
    sysfs writes a device's features as one character per bit, bit 0 first."""
    found = None
    for device in tree.glob("/sys/bus/virtio/devices/*"):
        if tree.read(device + "/device") == VIRTIO_BALLOON:
            features = tree.read(device + "/features") or ""
            on = len(features) > BALLOON_REPORTING_BIT and features[BALLOON_REPORTING_BIT] == "1"
            found = bool(found) or on
    return found


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
