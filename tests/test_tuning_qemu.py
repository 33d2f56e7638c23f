"""The tuning roles on a VM with a kernel of its own (QEMU, software emulation): what nspawn cannot show.

Applied twice in one boot (zram and started slices last one boot): the second run changes
nothing, and the kernel holds the plan: vm.swappiness, a zram0 swap of the planned size, and
vlserve.slice's effective cpuset. Then the audit finds nothing drifting.
"""

from __future__ import annotations

import os

import pytest

from harness import qemu
from harness.playbooks import audit, play, recap

REASON = qemu.available()
if REASON and os.environ.get("CI"):
    raise RuntimeError("the QEMU tier must run in CI: %s" % REASON)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# Inference on CPU 1 only: a cpuset that differs from "everything" proves AllowedCPUs= took effect.
HOST_VARS = {"vlserve_facts_allowed_cpus": "1"}


@pytest.fixture(scope="module")
def vm():
    with qemu.QemuHost(memory_mib=8192, cpus=2) as host:
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
    assert report["summary"]["drift"] == 0, report["knobs"]
