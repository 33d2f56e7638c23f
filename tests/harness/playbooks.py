"""Running the project's playbooks against a harness host, and reading what they say."""

from __future__ import annotations

import json
import pathlib
import re

from conftest import run_tool
from harness.host import connection_vars


def play(host, workdir: pathlib.Path, playbook: str, *args: str, check: bool = False, **host_vars):
    inventory = host.inventory(workdir, **host_vars)
    return run_tool(
        "ansible-playbook", "-i", str(inventory), playbook, *args, *(["--check"] if check else []), timeout=1800
    )


def recap(result) -> dict[str, int]:
    """The PLAY RECAP counters of the guest (ok, changed, failed, ...)."""
    match = re.search(r"guest\s+:\s+(.*)", result.stdout)
    assert match, result.stdout[-3000:] + result.stderr[-3000:]
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", match.group(1))}


def audit(host, workdir: pathlib.Path, **host_vars) -> dict:
    """Run the audit (in check mode) and return the guest's JSON report."""
    reports = workdir / "reports"
    result = play(host, workdir, "playbooks/audit.yml", "-e", "audit_report_dir=%s" % reports, check=True, **host_vars)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((reports / "guest.json").read_text())


def write_fleet_inventory(directory: pathlib.Path, groups: dict, **common) -> pathlib.Path:
    """An inventory of several harness hosts: {group: {name: (host, {host variables})}}, every host
    reached on its own loopback address, `common` variables for all."""
    inventory: dict = {"all": {"vars": common, "children": {}}}
    for group, members in groups.items():
        hosts = {name: {**connection_vars(host), **variables} for name, (host, variables) in members.items()}
        inventory["all"]["children"][group] = {"hosts": hosts}
    path = directory / "fleet-inventory.json"
    path.write_text(json.dumps(inventory, indent=2))
    return path


def play_inventory(inventory: pathlib.Path, playbook: str, *args: str, check: bool = False):
    return run_tool(
        "ansible-playbook", "-i", str(inventory), playbook, *args, *(["--check"] if check else []), timeout=2400
    )


def recaps(result) -> dict[str, dict[str, int]]:
    """The PLAY RECAP counters of every host."""
    found = {}
    for name, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", result.stdout, re.M):
        found[name] = {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", counters)}
    assert found, result.stdout[-3000:] + result.stderr[-3000:]
    return found
