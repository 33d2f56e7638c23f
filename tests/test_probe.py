"""The probe: on this machine against lscpu and /proc/meminfo, and on built /proc + /sys trees."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jsonschema
import pytest

from vlserve import sizing


@pytest.fixture(scope="module")
def live():
    return sizing.probe()


def lscpu_flags() -> set[str]:
    return set(subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.split())


def lscpu_rows():
    out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        cpu, core, socket, node = line.split(",")
        rows.append((int(cpu), int(core), int(socket), int(node or 0)))
    return rows


def meminfo_bytes(key):
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_live_probe_matches_its_schema(live, facts_schema):
    jsonschema.validate(live, facts_schema)


def test_live_probe_agrees_with_lscpu(live):
    rows = lscpu_rows()
    assert live["cpu"]["logical_cpus"] == len(rows)
    assert live["cpu"]["physical_cores"] == len({(socket, core) for _, core, socket, _ in rows})
    assert live["cpu"]["sockets"] == len({socket for _, _, socket, _ in rows})
    assert len(live["cpu"]["numa_nodes"]) == len({node for *_, node in rows})
    for cpu, _, socket, node in rows:
        entry = next(e for e in live["cpu"]["topology"] if e["cpu"] == cpu)
        assert (entry["package"], entry["node"]) == (socket, node)
    flags = lscpu_flags()
    held = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"  # the suite held to AVX2
    for name, present in live["cpu"]["isa"].items():
        assert present == (name in flags and not (held and name.startswith(("avx512", "amx")))), name


def test_torch_held_to_avx2_holds_the_plan_there_too(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (an operator's hold, or an AVX2 host imitated): the probe reports no ISA
    above AVX2, so the plan never counts on bfloat16 packing or the AVX-512 tier torch will not run."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    held = sizing.probe(use_libraries=False)
    assert not any(v for k, v in held["cpu"]["isa"].items() if k.startswith(("avx512", "amx")))
    assert held["cpu"]["isa"]["avx2"] == ("avx2" in lscpu_flags())
    if any(f.startswith(("avx512", "amx")) for f in lscpu_flags()):
        assert held["sources"]["isa"].endswith("held to AVX2 by ATEN_CPU_CAPABILITY")


def test_live_probe_agrees_with_proc_meminfo(live):
    assert live["memory"]["total_bytes"] == meminfo_bytes("MemTotal")
    assert live["memory"]["swap_total_bytes"] == meminfo_bytes("SwapTotal")
    # MemAvailable moves while the tests run; a few hundred MiB is noise, not disagreement.
    assert abs(live["memory"]["available_bytes"] - meminfo_bytes("MemAvailable")) < 512 * sizing.MIB
    assert live["limits"]["affinity"] == sorted(os.sched_getaffinity(0))


def test_a_worker_s_openmp_binding_does_not_shrink_the_probe():
    """A worker's environment binds OpenMP threads to places: libgomp then pins the first thread to the
    first place as torch loads, so the thread's own mask shows one CPU. The probe must still see every
    CPU the process started on, or a bench run in that environment plans (and runs) one thread."""
    started = sorted(os.sched_getaffinity(0))
    if len(started) < 2:
        pytest.skip("one CPU: a binding cannot narrow it")
    script = (
        "import json, os, vlserve, torch\n"
        "from vlserve import sizing\n"
        "torch.ones(1 << 20).sum()\n"  # a parallel region: the runtime is up and has placed its threads
        "print(json.dumps([sorted(os.sched_getaffinity(0))]"
        " + [sizing.probe(use_libraries=u)['limits']['allowed_cpus'] for u in (True, False)]))\n"
    )
    places = ",".join("{%d}" % cpu for cpu in started)
    env = dict(os.environ, OMP_PROC_BIND="close", OMP_PLACES=places, OMP_NUM_THREADS=str(len(started)))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    thread_mask, with_libraries, from_files = json.loads(out.stdout.splitlines()[-1])
    assert thread_mask == started[:1], "the runtime did not bind the first thread: nothing was tested"
    online = {entry["cpu"] for entry in sizing.probe()["cpu"]["topology"]}
    assert with_libraries == from_files == sorted(online.intersection(started))


def test_library_and_file_sources_agree(live):
    plain = sizing.probe(use_libraries=False)
    assert plain["sources"]["memory"] == "/proc/meminfo" and live["sources"]["memory"] == "psutil"
    assert plain["cpu"]["topology"] == live["cpu"]["topology"]
    assert plain["cpu"]["isa"] == live["cpu"]["isa"]
    assert plain["memory"]["total_bytes"] == live["memory"]["total_bytes"]
    assert plain["limits"]["allowed_cpus"] == live["limits"]["allowed_cpus"]


class Tree:
    """A /proc + /sys tree to probe, written file by file."""

    def __init__(self, root: pathlib.Path):
        self.root = root

    def write(self, path: str, text: str) -> Tree:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
        return self

    def cpus(self, layout, nodes=None):
        """layout: list of sibling groups, e.g. [[0, 4], [1, 5]]; nodes: {node: [cpus]}."""
        every = sorted(c for group in layout for c in group)
        self.write("/sys/devices/system/cpu/online", sizing.format_cpu_list(every))
        for group in layout:
            for cpu in group:
                base = "/sys/devices/system/cpu/cpu%d" % cpu
                self.write(base + "/topology/core_cpus_list", sizing.format_cpu_list(group))
                self.write(base + "/topology/physical_package_id", "0")
        for node, members in (nodes or {0: every}).items():
            self.write("/sys/devices/system/node/node%d/cpulist" % node, sizing.format_cpu_list(members))
        self.write(
            "/proc/cpuinfo",
            "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\n"
            "flags\t\t: fpu avx2 avx512f avx512_bf16 hypervisor\n",
        )
        self.write(
            "/proc/meminfo", "MemTotal:       16384000 kB\nMemAvailable:   12000000 kB\nSwapTotal:       4194300 kB\n"
        )
        self.write("/proc/self/status", "Name:\tprobe\nCpus_allowed_list:\t%s\n" % sizing.format_cpu_list(every))
        return self


@pytest.fixture
def tree(tmp_path):
    return Tree(tmp_path)


def test_tree_smt_numa_and_meminfo(tree):
    tree.cpus([[0, 4], [1, 5], [2, 6], [3, 7]], nodes={0: [0, 1, 4, 5], 1: [2, 3, 6, 7]})
    facts = sizing.probe(str(tree.root))
    cpu = facts["cpu"]
    assert (cpu["logical_cpus"], cpu["physical_cores"], cpu["threads_per_core"]) == (8, 4, 2)
    assert cpu["numa_nodes"] == {"0": [0, 1, 4, 5], "1": [2, 3, 6, 7]}
    assert cpu["isa"]["avx512_bf16"] and not cpu["isa"]["amx_bf16"]
    assert facts["memory"]["total_bytes"] == 16384000 * 1024
    assert facts["memory"]["available_bytes"] == 12000000 * 1024
    assert facts["sources"]["memory"] == "/proc/meminfo"
    assert facts["platform"]["vm"] == "unknown"  # only the hypervisor CPU flag says so


def test_tree_cgroup_v2_quota_cpuset_and_memory_limit(tree):
    tree.cpus([[c] for c in range(16)])
    tree.write("/proc/self/cgroup", "0::/docker/abc")
    tree.write("/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids")
    tree.write("/sys/fs/cgroup/docker/abc/cpuset.cpus.effective", "0-7")
    tree.write("/sys/fs/cgroup/docker/abc/cpu.max", "250000 100000")
    tree.write("/sys/fs/cgroup/docker/cpu.max", "max 100000")
    tree.write("/sys/fs/cgroup/docker/abc/memory.max", "max")
    tree.write("/sys/fs/cgroup/docker/memory.max", str(8 * sizing.GIB))
    tree.write("/sys/fs/cgroup/docker/abc/memory.current", str(sizing.GIB))
    tree.write("/.dockerenv", "")
    limits = sizing.probe(str(tree.root))["limits"]
    assert limits["cgroup_version"] == "v2"
    assert limits["cgroup_cpuset"] == list(range(8))
    assert limits["allowed_cpus"] == list(range(8))
    assert (limits["cpu_quota"], limits["cpu_quota_cpus"]) == (2.5, 2)
    assert limits["memory_limit_bytes"] == 8 * sizing.GIB  # the parent's limit is the tighter one
    assert limits["memory_usage_bytes"] == sizing.GIB
    assert sizing.probe(str(tree.root))["platform"]["container"] == "docker"


def test_tree_cpus_of_our_own_slice_stay_in_the_plan_once_the_system_is_confined(tree):
    """After confine_system, the probe runs on the housekeeping cores; vlserve.slice's CPUs are still ours."""
    tree.cpus([[c] for c in range(4)])
    tree.write("/proc/self/cgroup", "0::/user.slice/user-0.slice/session-3.scope")
    tree.write("/proc/self/status", "Name:\tprobe\nCpus_allowed_list:\t0\n")
    tree.write("/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids")
    tree.write("/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope/cpuset.cpus.effective", "0")
    assert sizing.probe(str(tree.root))["limits"]["allowed_cpus"] == [0]  # no slice of ours yet
    tree.write("/sys/fs/cgroup/vlserve.slice/cgroup.controllers", "cpuset cpu memory")
    tree.write("/sys/fs/cgroup/vlserve.slice/cpuset.cpus.effective", "1-3")
    limits = sizing.probe(str(tree.root))["limits"]
    assert limits["vlserve_slice_cpus"] == [1, 2, 3]
    assert limits["allowed_cpus"] == [0, 1, 2, 3]


def test_tree_cgroup_v1_cfs_quota(tree):
    tree.cpus([[c] for c in range(4)])
    tree.write("/proc/self/cgroup", "4:memory:/lxc/box\n3:cpu,cpuacct:/lxc/box\n2:cpuset:/lxc/box")
    tree.write("/sys/fs/cgroup/cpu/lxc/box/cpu.cfs_quota_us", "150000")
    tree.write("/sys/fs/cgroup/cpu/lxc/box/cpu.cfs_period_us", "100000")
    tree.write("/sys/fs/cgroup/cpuset/lxc/box/cpuset.effective_cpus", "1-3")
    tree.write("/sys/fs/cgroup/memory/lxc/box/memory.limit_in_bytes", "9223372036854771712")
    limits = sizing.probe(str(tree.root))["limits"]
    assert limits["cgroup_version"] == "v1"
    assert (limits["cpu_quota"], limits["cpu_quota_cpus"]) == (1.5, 1)
    assert limits["allowed_cpus"] == [1, 2, 3]
    assert limits["memory_limit_bytes"] is None  # v1's "unlimited"


def test_tree_wsl2(tree):
    tree.cpus([[c] for c in range(8)])
    tree.write("/proc/sys/kernel/osrelease", "5.15.167.4-microsoft-standard-WSL2")
    platform = sizing.probe(str(tree.root))["platform"]
    assert (platform["kind"], platform["wsl"], platform["wsl_version"], platform["vm"]) == ("wsl", True, 2, "microsoft")


def test_tree_virtio_balloon_free_page_reporting(tree, facts_schema):
    """sysfs spells a virtio device's features one character per bit, bit 0 first: the balloon's bit 5
    (VIRTIO_BALLOON_F_REPORTING) says whether the host takes freed memory back. Other devices' bit 5
    means something else; no balloon, no answer."""
    tree.cpus([[0], [1]])
    tree.write("/sys/bus/virtio/devices/virtio1/device", "0x0001")  # a network card: its bit 5 is not ours
    tree.write("/sys/bus/virtio/devices/virtio1/features", "1" * 64)
    assert sizing.probe(str(tree.root))["memory"]["free_page_reporting"] is None
    tree.write("/sys/bus/virtio/devices/virtio0/device", "0x0005")
    tree.write("/sys/bus/virtio/devices/virtio0/features", "0110000000000000000000000000000010000000")
    facts = sizing.probe(str(tree.root))
    assert facts["memory"]["free_page_reporting"] is False
    assert "virtio, no free page reporting" in sizing.render_facts(facts)
    tree.write("/sys/bus/virtio/devices/virtio0/features", "0110010000000000000000000000000010000000")
    facts = sizing.probe(str(tree.root))
    assert facts["memory"]["free_page_reporting"] is True
    assert "reports free pages" in sizing.render_facts(facts)
    jsonschema.validate(facts, facts_schema)
    del facts["memory"]["free_page_reporting"]  # facts written before the field: valid, no row
    jsonschema.validate(facts, facts_schema)
    assert "balloon" not in sizing.render_facts(facts)


def test_tree_hybrid_cpu_atom_and_cpufreq(tree):
    tree.cpus([[0, 1], [2, 3], [4], [5], [6], [7]])
    tree.write("/sys/devices/cpu_atom/cpus", "4-7")
    for cpu in range(8):
        base = "/sys/devices/system/cpu/cpu%d/cpufreq" % cpu
        tree.write(base + "/scaling_governor", "powersave" if cpu else "performance")
        tree.write(base + "/scaling_available_governors", "performance powersave")
        tree.write(base + "/scaling_driver", "intel_pstate")
        tree.write(base + "/energy_performance_preference", "balance_performance")
        tree.write(base + "/energy_performance_available_preferences", "default performance balance_performance")
    facts = sizing.probe(str(tree.root))
    assert facts["cpu"]["efficiency_cpus"] == [4, 5, 6, 7]
    assert facts["cpu"]["physical_cores"] == 6
    assert facts["cpufreq"]["governors"] == {"performance": [0], "powersave": [1, 2, 3, 4, 5, 6, 7]}
    assert facts["cpufreq"]["driver"] == "intel_pstate"
    assert "performance" in facts["cpufreq"]["available_energy_performance_preferences"]
    result = sizing.plan(facts)
    assert result["cores"]["usable"] == [0, 2]
    assert result["knobs"]["energy_performance_preference"]["applies"] is True


def test_tree_zram_and_swaps(tree):
    tree.cpus([[0], [1]])
    tree.write("/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/dev/zram0 partition 4194300 0 100")
    tree.write("/sys/block/zram0/disksize", str(4 * sizing.GIB))
    tree.write("/sys/block/zram0/comp_algorithm", "lzo lzo-rle lz4 [zstd]")
    tree.write("/sys/module/zram/uevent", "")
    memory = sizing.probe(str(tree.root))["memory"]
    assert memory["zram"] == {
        "available": True,
        "devices": [{"name": "zram0", "disksize_bytes": 4 * sizing.GIB, "algorithm": "zstd"}],
        "algorithms": ["lz4", "lzo", "lzo-rle", "zstd"],  # what the kernel offers, for the plan to choose from
    }
    assert memory["swaps"] == [
        {"name": "/dev/zram0", "type": "partition", "size_bytes": 4194300 * 1024, "priority": 100}
    ]


def test_tree_arm_features_and_a_hyphenated_zram_algorithm(tree):
    tree.cpus([[0], [1]])
    tree.write(
        "/proc/cpuinfo",
        "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
        "jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp "
        "svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n",
    )
    tree.write("/sys/block/zram0/comp_algorithm", "lzo [lzo-rle] lz4 zstd")
    facts = sizing.probe(str(tree.root))
    isa = facts["cpu"]["isa"]
    assert isa["bf16"] and isa["i8mm"] and isa["sve"] and isa["asimddp"] and not isa["avx2"]
    assert facts["memory"]["zram"]["devices"][0]["algorithm"] == "lzo-rle"


def test_cpu_list_round_trip():
    assert sizing.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert sizing.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert sizing.parse_cpu_list("") == []
