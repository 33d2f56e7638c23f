"""Build facts (schema vlserve.facts/1) for hosts this machine is not: the fixtures and the property tests.

`python tests/topology_builder.py` rewrites tests/fixtures/topologies/*.json from HOSTS below; the
real captures (xeon-avx512bf16-2vcpu-vm.json, a 2-vCPU Xeon VM with AVX-512 VNNI and BF16, no AMX;
epyc-zen4-avx512bf16-2vcpu-vm.json, a 2-vCPU AMD EPYC VM with the same ISA) come from
`vlserve probe --json` and are left alone.
"""

from __future__ import annotations

import json
import pathlib
import sys

GIB = 1024**3
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "topologies"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "service"))
from vlserve.sizing import ISA_FLAGS as ISA_NAMES  # noqa: E402 - the probe's own list


def build_facts(
    *,
    hostname,
    model_name,
    sockets,
    cores_per_socket,
    threads_per_core,
    nodes_per_socket=1,
    efficiency_cores=0,
    isa=(),
    total_gib,
    available_gib,
    swaps=(),
    zram=True,
    cpufreq=None,
    kind="bare-metal",
    vm=None,
    container=None,
    wsl=False,
    cgroup_version="v2",
    init="systemd",
    cpu_quota=None,
    memory_limit_gib=None,
    memory_usage_gib=None,
    allowed=None,
    os_id="debian",
    os_version="12",
    kernel="6.1.0-28-amd64",
    vendor="GenuineIntel",
    arch="x86_64",
    zram_algorithms=None,
    sysctl_swappiness=60,
    description="",
):
    """Facts for a host laid out like Linux numbers CPUs: first thread of every core, then the
    SMT siblings; P-cores before E-cores; NUMA nodes split each socket's cores evenly."""
    physical = sockets * cores_per_socket
    topology = []
    node_cpus = {}
    cores_per_node = cores_per_socket // nodes_per_socket
    p_cores = physical - efficiency_cores
    for core in range(physical):
        package = core // cores_per_socket
        node = package * nodes_per_socket + (core % cores_per_socket) // max(1, cores_per_node)
        node = min(node, (package + 1) * nodes_per_socket - 1)
        smt = threads_per_core if core < p_cores else 1  # E-cores have no SMT
        # SMT siblings are numbered after every core's first thread, as on Intel and AMD servers.
        siblings = [core] + [physical * t + core for t in range(1, smt)]
        for cpu in siblings:
            topology.append(
                {
                    "cpu": cpu,
                    "package": package,
                    "core_cpus": sorted(siblings),
                    "capacity": None,
                    "max_freq_khz": None,
                    "node": node,
                }
            )
            node_cpus.setdefault(str(node), []).append(cpu)
    topology.sort(key=lambda e: e["cpu"])
    cpus = [e["cpu"] for e in topology]
    e_cpus = sorted(e["cpu"] for e in topology if p_cores <= e["core_cpus"][0] < physical)
    affinity = sorted(allowed) if allowed is not None else cpus
    quota_cpus = max(1, int(cpu_quota)) if cpu_quota is not None else None
    governors, available_governors, epp, epp_available, driver = {}, [], {}, [], None
    if cpufreq:
        driver = cpufreq
        governors = {"powersave": cpus}
        available_governors = ["performance", "powersave"]
        if cpufreq in ("intel_pstate", "amd-pstate-epp"):
            epp = {"balance_performance": cpus}
            epp_available = ["default", "performance", "balance_performance", "balance_power", "power"]
        else:
            available_governors = ["conservative", "ondemand", "userspace", "powersave", "performance", "schedutil"]
            governors = {"schedutil": cpus}
    swap_total = sum(s["size_bytes"] for s in swaps)
    return {
        "schema": "vlserve.facts/1",
        "description": description,
        "hostname": hostname,
        "cpu": {
            "arch": arch,
            "vendor": vendor,
            "model_name": model_name,
            "logical_cpus": len(cpus),
            "physical_cores": physical,
            "sockets": sockets,
            "threads_per_core": threads_per_core,
            "numa_nodes": {k: sorted(v) for k, v in sorted(node_cpus.items())},
            "efficiency_cpus": e_cpus,
            "isa": {name: name in isa for name in ISA_NAMES},
            "topology": topology,
        },
        "limits": {
            "cgroup_version": cgroup_version,
            "affinity": affinity,
            "cgroup_cpuset": affinity if allowed is not None else None,
            "allowed_cpus": affinity,
            "cpu_quota": cpu_quota,
            "cpu_quota_cpus": quota_cpus,
            "memory_limit_bytes": int(memory_limit_gib * GIB) if memory_limit_gib else None,
            "memory_usage_bytes": int(memory_usage_gib * GIB) if memory_usage_gib else None,
            "vlserve_slice_bytes": None,
        },
        "memory": {
            "total_bytes": int(total_gib * GIB),
            "available_bytes": int(available_gib * GIB),
            "swap_total_bytes": swap_total,
            "swaps": list(swaps),
            "zram": {"available": zram, "devices": [], "algorithms": zram_algorithms},
        },
        "cpufreq": {
            "available": bool(cpufreq),
            "driver": driver,
            "governors": governors,
            "available_governors": available_governors,
            "energy_performance_preferences": epp,
            "available_energy_performance_preferences": epp_available,
        },
        "platform": {
            "kind": kind,
            "container": container,
            "vm": vm,
            "wsl": wsl,
            "wsl_version": 2 if wsl else None,
            "kernel": kernel,
            "init": init,
            "os": {"id": os_id, "version_id": os_version, "like": None, "pretty_name": "%s %s" % (os_id, os_version)},
        },
        "sysctl": {"vm.swappiness": sysctl_swappiness, "vm.page-cluster": 3},
        "sources": {"capture": "tests/topology_builder.py"},
    }


DISK_SWAP = {"name": "/dev/sda3", "type": "partition", "size_bytes": 8 * GIB, "priority": -2}

HOSTS = {
    "xeon-gold-6248r-2s": dict(
        description="Two-socket Cascade Lake server, 32 cores / 64 threads as filed (2 x 16 used cores), "
        "128 GiB, AVX-512 VNNI without BF16, intel_pstate",
        hostname="gold6248r",
        model_name="Intel(R) Xeon(R) Gold 6248R CPU @ 3.00GHz",
        sockets=2,
        cores_per_socket=16,
        threads_per_core=2,
        nodes_per_socket=1,
        isa=("avx2", "avx512f", "avx512_vnni"),
        total_gib=125.6,
        available_gib=119.0,
        swaps=(DISK_SWAP,),
        cpufreq="intel_pstate",
    ),
    "xeon-e5-2680v4": dict(
        description="Broadwell server, 14 cores / 28 threads, 64 GiB, AVX2 only, acpi-cpufreq",
        hostname="e5-2680v4",
        model_name="Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz",
        sockets=1,
        cores_per_socket=14,
        threads_per_core=2,
        isa=("avx2",),
        total_gib=62.8,
        available_gib=60.1,
        cpufreq="acpi-cpufreq",
        os_id="ubuntu",
        os_version="22.04",
        kernel="5.15.0-122-generic",
    ),
    "i7-11800h-laptop-8g": dict(
        description="Tiger Lake laptop, 8 cores / 16 threads, 8 GB (7.6 GiB usable), AVX-512 without BF16",
        hostname="laptop-tgl",
        model_name="11th Gen Intel(R) Core(TM) i7-11800H @ 2.30GHz",
        sockets=1,
        cores_per_socket=8,
        threads_per_core=2,
        isa=("avx2", "avx512f", "avx512_vnni"),
        total_gib=7.6,
        available_gib=6.6,
        swaps=({"name": "/swap.img", "type": "file", "size_bytes": 2 * GIB, "priority": -2},),
        cpufreq="intel_pstate",
        os_id="ubuntu",
        os_version="24.04",
        kernel="6.8.0-48-generic",
    ),
    "epyc-7763-2s-nps4": dict(
        description="Two-socket Milan, 2 x 64 cores / 256 threads, NPS4 (8 NUMA nodes), 512 GiB, AVX2",
        hostname="epyc-milan",
        model_name="AMD EPYC 7763 64-Core Processor",
        vendor="AuthenticAMD",
        sockets=2,
        cores_per_socket=64,
        threads_per_core=2,
        nodes_per_socket=4,
        isa=("avx2",),
        total_gib=503.0,
        available_gib=490.0,
        cpufreq="acpi-cpufreq",
        os_id="rocky",
        os_version="9.4",
        kernel="5.14.0-427.el9.x86_64",
    ),
    "sapphire-rapids-amx": dict(
        description="Sapphire Rapids, 56 cores / 112 threads, one socket, 256 GiB, AMX and AVX-512 BF16",
        hostname="spr-8480",
        model_name="Intel(R) Xeon(R) Platinum 8480+",
        sockets=1,
        cores_per_socket=56,
        threads_per_core=2,
        isa=("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"),
        total_gib=251.0,
        available_gib=244.0,
        cpufreq="intel_pstate",
    ),
    "alder-lake-hybrid-laptop": dict(
        description="Alder Lake laptop, 6 P-cores (12 threads) + 8 E-cores, 16 GiB, AVX2 (AVX-512 fused off)",
        hostname="laptop-adl",
        model_name="12th Gen Intel(R) Core(TM) i7-12700H",
        sockets=1,
        cores_per_socket=14,
        efficiency_cores=8,
        threads_per_core=2,
        isa=("avx2",),
        total_gib=15.4,
        available_gib=12.9,
        swaps=(DISK_SWAP,),
        cpufreq="intel_pstate",
        os_id="ubuntu",
        os_version="24.04",
        kernel="6.8.0-48-generic",
    ),
    "wsl2-8cpu-6g": dict(
        description="WSL2 guest on a Tiger Lake laptop: 8 logical CPUs, 6 GiB (the .wslconfig limit)",
        hostname="wsl-box",
        model_name="11th Gen Intel(R) Core(TM) i7-1165G7 @ 2.80GHz",
        sockets=1,
        cores_per_socket=4,
        threads_per_core=2,
        isa=("avx2", "avx512f", "avx512_vnni"),
        total_gib=5.8,
        available_gib=5.3,
        swaps=({"name": "/dev/sdb", "type": "partition", "size_bytes": 2 * GIB, "priority": -2},),
        zram=False,
        kind="wsl",
        vm="microsoft",
        wsl=True,
        os_id="ubuntu",
        os_version="24.04",
        kernel="5.15.167.4-microsoft-standard-WSL2",
    ),
    "container-quota-2.5-of-16": dict(
        description="Docker container limited by cpu.max to 2.5 CPUs and 32 GiB on a 16-CPU Ice Lake host",
        hostname="c0ffee",
        model_name="Intel(R) Xeon(R) Gold 6338N CPU @ 2.20GHz",
        sockets=1,
        cores_per_socket=8,
        threads_per_core=2,
        isa=("avx2", "avx512f", "avx512_vnni"),
        total_gib=62.0,
        available_gib=50.0,
        kind="container",
        container="docker",
        cpu_quota=2.5,
        memory_limit_gib=32,
        memory_usage_gib=0.2,
        init="sh",
    ),
    "cloud-vm-2vcpu": dict(
        description="2-vCPU cloud VM (m7i.large-like: one core, two threads), 8 GiB, KVM, no cpufreq, AMX",
        hostname="ip-10-0-0-12",
        model_name="Intel(R) Xeon(R) Platinum 8488C",
        sockets=1,
        cores_per_socket=1,
        threads_per_core=2,
        isa=("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"),
        total_gib=7.6,
        available_gib=7.1,
        kind="vm",
        vm="amazon",
        os_id="debian",
        os_version="12",
        kernel="6.1.0-28-cloud-amd64",
    ),
}

HOSTS.update(
    {
        "graviton3-c7g-16": dict(
            description="AWS Graviton3 (c7g.4xlarge-like): 16 Neoverse-V1 cores, no SMT, 32 GiB, KVM, no cpufreq; "
            "Features list bf16, i8mm, sve, asimddp",
            hostname="ip-10-0-1-7",
            model_name="Neoverse-V1",
            vendor="ARM",
            arch="aarch64",
            sockets=1,
            cores_per_socket=16,
            threads_per_core=1,
            isa=("asimddp", "bf16", "i8mm", "sve"),
            total_gib=30.8,
            available_gib=29.9,
            kind="vm",
            vm="amazon",
            os_id="ubuntu",
            os_version="24.04",
            kernel="6.8.0-1018-aws",
        ),
        "ampere-altra-q80": dict(
            description="Ampere Altra Q80-30: 80 Neoverse-N1 cores, one socket, 256 GiB, cppc_cpufreq; asimddp, "
            "no bf16, no i8mm, no SVE",
            hostname="altra",
            model_name="Neoverse-N1",
            vendor="ARM",
            arch="aarch64",
            sockets=1,
            cores_per_socket=80,
            threads_per_core=1,
            isa=("asimddp",),
            total_gib=250.0,
            available_gib=243.0,
            cpufreq="cppc_cpufreq",
            os_id="rocky",
            os_version="9.4",
            kernel="5.14.0-427.el9.aarch64",
        ),
        "ubuntu2004-kernel-5.4": dict(
            description="Ubuntu 20.04 VM on its 5.4 kernel: 4 vCPUs, 16 GiB, zram the only swap; swappiness above "
            "100 is refused before Linux 5.8",
            hostname="focal",
            model_name="Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz",
            sockets=1,
            cores_per_socket=2,
            threads_per_core=2,
            isa=("avx2", "avx512f", "avx512_vnni"),
            total_gib=15.6,
            available_gib=14.8,
            swaps=({"name": "/dev/zram0", "type": "partition", "size_bytes": 4 * GIB, "priority": 100},),
            zram_algorithms=["lz4", "lz4hc", "lzo", "lzo-rle", "zstd"],
            kind="vm",
            vm="kvm",
            os_id="ubuntu",
            os_version="20.04",
            kernel="5.4.0-150-generic",
        ),
        "rhel8-kernel-4.18": dict(
            description="RHEL 8 server on its 4.18 kernel: 16 cores / 32 threads, 64 GiB, no swap; its zram lists "
            "lzo, lz4, lz4hc, 842 and deflate (no zstd)",
            hostname="rhel8",
            model_name="Intel(R) Xeon(R) Silver 4216 CPU @ 2.10GHz",
            sockets=1,
            cores_per_socket=16,
            threads_per_core=2,
            isa=("avx2", "avx512f", "avx512_vnni"),
            total_gib=62.5,
            available_gib=60.0,
            zram_algorithms=["842", "deflate", "lz4", "lz4hc", "lzo"],
            cpufreq="intel_pstate",
            os_id="rhel",
            os_version="8.9",
            kernel="4.18.0-513.5.1.el8_9.x86_64",
        ),
    }
)


def write_fixtures() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, spec in HOSTS.items():
        path = FIXTURES / (name + ".json")
        path.write_text(json.dumps(build_facts(**spec), indent=2, sort_keys=True) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    write_fixtures()
    sys.exit(0)
