"""The tuning roles and the audit on a real systemd host (a systemd-nspawn container).

In order, on one throwaway container: bad values fail before any change; the audit shows drift;
site.yml applies; a second run changes nothing; a --check run changes nothing under /etc; the
audit then finds every knob ok (or not applicable in a container, with the reason); the files
are there with their headers. Last, the paths this machine cannot exercise (a real cpufreq
governor, WSL2) run against facts that say so.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest

from harness import nspawn
from harness.host import RELEASES
from harness.playbooks import audit, play, recap
from harness.releases import checkout_release

REASON = nspawn.available()
if REASON and os.environ.get("CI"):
    raise RuntimeError("the systemd tier must run in CI: %s" % REASON)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

ETC = ("/etc",)


@pytest.fixture(scope="module", params=RELEASES)
def guest(request):
    """A fresh container of each Debian release the roles support (12 and 13), one after the other."""
    with nspawn.NspawnHost(release=request.param) as host:
        yield host


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("nspawn")


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("vlserve_facts_swappiness", 500, "vlserve_facts_swappiness must be empty or an integer from 0 to 200"),
        ("vlserve_facts_zram_fraction", "lots", "vlserve_facts_zram_fraction"),
        ("vlserve_facts_objective", "fastest", "vlserve_facts_objective"),
        ("vlserve_facts_allowed_cpus", "0-4095", "vlserve_facts_allowed_cpus has CPUs"),
        ("vlserve_openmp_allocator", "mimalloc", "vlserve_openmp_allocator"),
        ("vlserve_deploy_settings", {"max_pixelz": 1}, "vlserve_deploy_settings.max_pixelz is not a setting"),
        ("vlserve_deploy_settings", {"max_batch_size": 0}, "vlserve_deploy_settings.max_batch_size: Input should be"),
        ("vlserve_facts_captured", {"schema": "vlserve.facts/1"}, "vlserve_facts_captured facts: facts: hostname"),
    ],
)
def test_bad_values_fail_before_any_change(guest, workdir, variable, value, message):
    before = guest.tree_digest(*ETC)
    result = play(guest, workdir, "site.yml", "-e", json.dumps({variable: value}))  # stops before anything
    assert result.returncode != 0
    assert message in result.stdout
    assert recap(result)["changed"] == 0
    assert guest.tree_digest(*ETC) == before


def test_audit_before_tuning_shows_drift(guest, workdir):
    report = audit(guest, workdir)
    status = {row["knob"]: row["status"] for row in report["knobs"]}
    assert status["swappiness"] == "drift" and status["openmp_runtime"] == "drift"
    assert status["cpu_isolation"] == "drift"  # no vlserve.slice yet
    for knob in ("cpu_governor", "zram", "wsl"):
        assert status[knob] == "n/a", knob
    assert report["facts"]["platform"]["container"] == "systemd-nspawn"
    assert report["summary"]["drift"] >= 3
    # Planned on the target by the sizing package Ansible shipped as module_utils: the guest has
    # only python3, no vlserve.
    assert report["plan"]["schema"] == "vlserve.plan/1"
    assert guest.ssh("python3 -c 'import vlserve'", check=False).returncode != 0


def test_site_applies(guest, workdir):
    result = play(guest, workdir, "playbooks/tune.yml")
    assert result.returncode == 0, result.stdout[-4000:]
    assert recap(result)["changed"] > 0


def test_second_run_changes_nothing(guest, workdir):
    result = play(guest, workdir, "playbooks/tune.yml")
    assert result.returncode == 0, result.stdout[-4000:]
    assert recap(result)["changed"] == 0, result.stdout[-4000:]


def test_check_mode_changes_nothing_under_etc(guest, workdir):
    before = guest.tree_digest(*ETC)
    result = play(guest, workdir, "playbooks/tune.yml", check=True)
    assert result.returncode == 0, result.stdout[-4000:]
    assert recap(result)["changed"] == 0
    assert guest.tree_digest(*ETC) == before


def test_audit_after_tuning_finds_every_knob_ok(guest, workdir):
    report = audit(guest, workdir, audit_fail_on_drift=True)
    assert report["summary"]["drift"] == 0, report["knobs"]
    for row in report["knobs"]:
        assert row["status"] in ("ok", "n/a"), row
        if row["status"] == "n/a":
            assert row["why"]


def test_the_host_holds_what_the_plan_says(guest, workdir):
    plan = audit(guest, workdir)["plan"]
    sysctl = guest.ssh("cat /etc/sysctl.d/90-vlserve.conf").stdout
    assert "vm.swappiness = %d" % plan["knobs"]["swappiness"]["value"] in sysctl
    cpus = ",".join(str(c) for c in plan["knobs"]["cpu_isolation"]["value"]["cpus"])
    shown = guest.ssh("systemctl show vlserve.slice -p AllowedCPUs --value").stdout.strip()
    assert shown.replace("-", ",") == cpus or shown == cpus.replace(",", "-")
    assert guest.ssh("systemctl is-active vlserve.slice").stdout.strip() == "active"
    guest.ssh("dpkg -s libgomp1 numactl > /dev/null")
    assert guest.ssh("numactl --hardware").returncode == 0


def test_every_rendered_file_carries_the_managed_header(guest):
    for path, role in (
        ("/etc/sysctl.d/90-vlserve.conf", "vlserve_memory"),
        ("/etc/systemd/system/vlserve.slice", "vlserve_cpu_isolation"),
        ("/etc/vlserve/runtime.env", "vlserve_openmp"),
    ):
        text = guest.ssh("cat %s" % path).stdout
        head = text.splitlines()[:3]  # ansible_managed | comment: "#", "# Managed by ...", "#"
        assert all(line.startswith("#") for line in head) and "Managed by Ansible (vlserve toolkit)" in head[1], path
        assert "by the %s role" % role in text, path


def test_paths_this_machine_cannot_exercise(guest, workdir):
    """A bare-metal host with cpufreq, then a WSL2 host, as facts; the roles write what they would."""
    facts = audit(guest, workdir)["facts"]
    cpus = [entry["cpu"] for entry in facts["cpu"]["topology"]]
    bare = copy.deepcopy(facts)
    bare["platform"].update(kind="bare-metal", container=None, vm=None)
    bare["cpufreq"].update(
        available=True,
        driver="intel_pstate",
        governors={"powersave": cpus},
        available_governors=["performance", "powersave"],
        energy_performance_preferences={"balance_performance": cpus},
        available_energy_performance_preferences=["default", "performance", "balance_power"],
    )
    bare["memory"]["zram"]["available"] = False
    bare["sysctl"] = {"vm.swappiness": 10, "vm.page-cluster": 3}  # nothing to apply to a container's /proc
    result = play(guest, workdir, "playbooks/tune.yml", "-e", json.dumps({"vlserve_facts_captured": bare}))
    assert result.returncode == 0, result.stdout[-4000:]
    unit = guest.ssh("cat /etc/systemd/system/vlserve-cpu-governor.service").stdout
    assert 'echo performance > "$f"' in unit and "energy_performance_preference" in unit
    assert guest.ssh("systemctl is-enabled vlserve-cpu-governor.service").stdout.strip() == "enabled"

    wsl = copy.deepcopy(facts)
    wsl["sysctl"] = bare["sysctl"]
    wsl["platform"].update(
        kind="wsl", container=None, vm="microsoft", wsl=True, wsl_version=2, kernel="5.15.167.4-microsoft-standard-WSL2"
    )
    guest.ssh(
        "mkdir -p /root/winprofile && printf '[wsl2]\\nkernelCommandLine = quiet\\n' > /root/winprofile/.wslconfig"
    )
    result = play(
        guest,
        workdir,
        "playbooks/tune.yml",
        "-e",
        json.dumps({"vlserve_facts_captured": wsl}),
        vlserve_wsl_windows_profile="/root/winprofile",
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "wsl --shutdown" in result.stdout
    assert "systemd = true" in guest.ssh("cat /etc/wsl.conf").stdout
    wslconfig = guest.ssh("cat /root/winprofile/.wslconfig").stdout
    assert "kernelCommandLine = quiet" in wslconfig  # the user's own setting stays
    assert re.search(r"memory = \d+GB", wslconfig) and "processors = %d" % len(cpus) in wslconfig


def test_a_host_running_tuned_gets_a_child_profile_instead_of_sysctl_d(guest, workdir):
    """tuned rewrites kernel settings from its profile: the role writes a child profile and switches to it."""
    guest.ssh(
        "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q tuned > /dev/null", timeout=900
    )
    guest.ssh("systemctl start tuned.service && tuned-adm profile balanced")
    first = play(guest, workdir, "playbooks/tune.yml")
    assert first.returncode == 0, first.stdout[-4000:]
    second = play(guest, workdir, "playbooks/tune.yml")
    assert recap(second)["changed"] == 0, second.stdout[-4000:]
    plan = audit(guest, workdir)["plan"]
    # tuned 2.23 and later (Debian 13) read user profiles from /etc/tuned/profiles.
    profile = guest.ssh("cat /etc/tuned/profiles/vlserve/tuned.conf 2>/dev/null || cat /etc/tuned/vlserve/tuned.conf")
    profile = profile.stdout
    assert "include=balanced" in profile
    assert "vm.swappiness=%d" % plan["knobs"]["swappiness"]["value"] in profile
    assert "vm.page-cluster=%d" % plan["knobs"]["page_cluster"]["value"] in profile
    assert "Managed by Ansible (vlserve toolkit)" in profile.splitlines()[1]
    assert guest.ssh("cat /etc/tuned/active_profile").stdout.strip() == "vlserve"
    assert guest.ssh("test -e /etc/sysctl.d/90-vlserve.conf", check=False).returncode != 0


def test_the_bare_release_installs_and_runs_on_this_releases_python(guest, tmp_path):
    """The release wheel with its base dependencies, installed from files alone into a venv of the
    host's own Python (Debian 12's 3.11, 13's 3.13): the planner and the renderers run, and --help
    lists nothing that needs the service's stack."""
    release = checkout_release(tmp_path / "release")
    version = guest.ssh("python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "--python-version",
            version,
            "--platform",
            "manylinux2014_x86_64",
            "--implementation",
            "cp",
            "--dest",
            str(wheels),
            release["path"],
            "pip",
        ],
        check=True,
        timeout=600,
    )
    guest.put(*sorted(wheels.iterdir()), to="/tmp/wheels")
    guest.ssh(
        # pip runs from its own wheel (a zip: the shell's glob cannot reach inside it, so name it first).
        "python3 -m venv --without-pip /tmp/bare && /tmp/bare/bin/python $(ls /tmp/wheels/pip-*.whl)/pip install -q "
        "--disable-pip-version-check --no-index --find-links /tmp/wheels vlserve"
    )
    listed = guest.ssh("cd / && /tmp/bare/bin/vlserve --help").stdout
    commands = {
        line.split()[0]
        for line in listed.split("COMMAND\n", 1)[1].split("\noptions:", 1)[0].splitlines()
        if re.match(r"^    \S", line)
    }
    assert commands == {"probe", "plan", "render-units", "render-fleet", "keys", "model", "deployment"}, commands
    assert guest.ssh("/tmp/bare/bin/vlserve --version").stdout.strip() == "vlserve " + release["version"]
    guest.ssh("cd / && /tmp/bare/bin/vlserve plan --json > /dev/null")
    guest.ssh("cd / && /tmp/bare/bin/vlserve render-units --out /tmp/rendered --front-bind 127.0.0.1")
    guest.ssh("test -f /tmp/rendered/etc/systemd/system/vlserve@.service")
