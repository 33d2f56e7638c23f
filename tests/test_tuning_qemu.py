"""The tuning roles on a VM with a kernel of its own (QEMU, software emulation): what nspawn cannot show.

Applied twice in one boot (zram and started slices last one boot): the second run changes
nothing, and the kernel holds the plan: vm.swappiness, a zram0 swap of the planned size, and
vlserve.slice's effective cpuset. Then the audit finds nothing drifting.
"""

from __future__ import annotations

import os

import pytest

from harness import qemu
from harness.host import KERNEL_RELEASES
from harness.playbooks import audit, play, recap

REASON = qemu.available()
if REASON and os.environ.get("CI"):
    raise RuntimeError("the QEMU tier must run in CI: %s" % REASON)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

# CPU 0 for housekeeping (the OS confined to it), CPU 1 for inference: cpusets that differ from
# "everything" prove that AllowedCPUs= took effect on every slice.
HOST_VARS = {"vlserve_facts_housekeeping_cores": 1, "vlserve_cpu_isolation_confine_system": True}


@pytest.fixture(scope="module", params=KERNEL_RELEASES)
def vm(request):
    """A VM of each release whose kernel the tier checks (harness.host.KERNEL_RELEASES)."""
    with qemu.QemuHost(memory_mib=8192, cpus=2, release=request.param) as host:
        yield host


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("qemu")


@pytest.fixture(scope="module")
def tuned(vm, workdir):
    first = play(vm, workdir, "playbooks/tune.yml", **HOST_VARS)
    assert first.returncode == 0, first.stdout[-5000:]
    second = play(vm, workdir, "playbooks/tune.yml", **HOST_VARS)
    assert second.returncode == 0, second.stdout[-5000:]
    return first, second


def test_second_run_changes_nothing(tuned):
    first, second = tuned
    assert recap(first)["changed"] > 0
    assert recap(second)["changed"] == 0, second.stdout[-5000:]


def test_the_kernel_holds_the_plan(vm, workdir, tuned):
    report = audit(vm, workdir, audit_fail_on_drift=True, **HOST_VARS)
    knobs = report["plan"]["knobs"]
    assert report["facts"]["platform"]["kind"] == "vm"
    assert int(vm.ssh("cat /proc/sys/vm/swappiness").stdout) == knobs["swappiness"]["value"] == 180
    assert int(vm.ssh("cat /proc/sys/vm/page-cluster").stdout) == knobs["page_cluster"]["value"] == 0
    swaps = [line.split() for line in vm.ssh("cat /proc/swaps").stdout.splitlines()[1:]]
    zram = [row for row in swaps if row[0] == "/dev/zram0"]
    assert zram, swaps
    assert int(vm.ssh("cat /sys/block/zram0/disksize").stdout) == knobs["zram"]["value"]["size_bytes"]
    assert int(zram[0][2]) * 1024 == knobs["zram"]["value"]["size_bytes"] - 4096  # /proc/swaps omits the header page
    assert "[%s]" % knobs["zram"]["value"]["algorithm"] in vm.ssh("cat /sys/block/zram0/comp_algorithm").stdout
    effective = vm.ssh("cat /sys/fs/cgroup/vlserve.slice/cpuset.cpus.effective").stdout.strip()
    assert effective == "1" and knobs["cpu_isolation"]["value"]["cpus"] == [1]
    assert knobs["cpu_isolation"]["value"]["housekeeping_cpus"] == [0]
    for confined in ("system.slice", "user.slice"):
        assert vm.ssh("cat /sys/fs/cgroup/%s/cpuset.cpus.effective" % confined).stdout.strip() == "0", confined
    assert report["summary"]["drift"] == 0, report["knobs"]


def test_the_zramctl_unit_takes_over_and_holds_the_plan(vm, workdir, tuned):
    """Where no zram-generator package exists (Ubuntu 22.04) a zramctl unit of ours makes the device.
    Only the memory role is re-applied, through its tag."""
    fallback = dict(HOST_VARS, vlserve_memory_zram_method="zramctl")
    first = play(vm, workdir, "playbooks/tune.yml", "--tags", "memory", **fallback)
    assert first.returncode == 0, first.stdout[-5000:]
    second = play(vm, workdir, "playbooks/tune.yml", "--tags", "memory", **fallback)
    assert second.returncode == 0, second.stdout[-5000:]
    assert recap(second)["changed"] == 0, second.stdout[-5000:]
    assert vm.ssh("systemctl is-active vlserve-zram.service").stdout.strip() == "active"
    assert vm.ssh("test -e /etc/systemd/zram-generator.conf", check=False).returncode != 0
    report = audit(vm, workdir, audit_fail_on_drift=True, **fallback)
    size = report["plan"]["knobs"]["zram"]["value"]["size_bytes"]
    swaps = [line.split() for line in vm.ssh("cat /proc/swaps").stdout.splitlines()[1:]]
    assert [row[0] for row in swaps] == ["/dev/zram0"], swaps
    assert int(swaps[0][2]) * 1024 == size - 4096
    assert report["summary"]["drift"] == 0, report["knobs"]
