"""The audit reads back what the roles wrote, whichever way they wrote it (sysctl.d or tuned, zram-generator
or the zramctl unit): rendered from the roles' own templates into a scratch root."""

from __future__ import annotations

import calendar
import pathlib
import subprocess
import time

import jinja2
import pytest

from conftest import REPO, load_topology
from vlserve import sizing
from vlserve.ops import audit
from vlserve.sizing import contract

MEMORY_TEMPLATES = REPO / "roles" / "vlserve_memory" / "templates"


def render(name: str, **context) -> str:
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    environment.filters["comment"] = lambda text: "#\n# %s\n#" % text
    return environment.from_string((MEMORY_TEMPLATES / name).read_text()).render(
        ansible_managed="Managed by Ansible (vlserve toolkit)", **context
    )


PLAN = {
    "knobs": {
        "zram": {"value": {"size_bytes": 4 * 2**30, "algorithm": "zstd", "priority": 100}, "why": "zram"},
        "swappiness": {"value": 180, "why": "zram only"},
        "page_cluster": {"value": 0, "why": "zram"},
    }
}


@pytest.fixture
def root(tmp_path) -> pathlib.Path:
    return tmp_path


def write(root: pathlib.Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.mark.parametrize("where", [audit.ZRAM_CONFIG, audit.ZRAM_UNIT])
def test_zram_written_by_either_method_reads_the_same(root, where):
    template = "zram-generator.conf.j2" if where == audit.ZRAM_CONFIG else "vlserve-zram.service.j2"
    write(root, where, render(template, vlserve_plan=PLAN))
    assert audit.probe_tuning(str(root))["zram_config"] == {
        **({"swap-priority": "100"} if where == audit.ZRAM_CONFIG else {}),
        "zram-size": "4096",
        "compression-algorithm": "zstd",
    }


@pytest.mark.parametrize("where", [audit.SYSCTL_FILE, *audit.TUNED_PROFILES])
def test_sysctls_written_to_sysctl_d_or_a_tuned_profile_read_the_same(root, where):
    if where == audit.SYSCTL_FILE:
        write(root, where, render("sysctl.conf.j2", vlserve_plan=PLAN))
    else:
        write(root, where, render("tuned.conf.j2", vlserve_plan=PLAN, __vlserve_memory_tuned_parent_profile="balanced"))
    assert audit.probe_tuning(str(root))["sysctl_file"] == {"vm.swappiness": "180", "vm.page-cluster": "0"}


def test_nothing_written_reads_as_nothing(root):
    tuning = audit.probe_tuning(str(root))
    assert tuning["zram_config"] is None and tuning["sysctl_file"] is None


def test_memory_headroom_names_the_pressure_of_other_processes():
    facts = load_topology("xeon-avx512bf16-2vcpu-vm")
    plan = sizing.plan(facts)
    needed = plan["workers"]["count"] * plan["memory"]["per_worker"]["high_bytes"]
    facts["limits"]["vlserve_slice_bytes"] = None
    facts["memory"]["available_bytes"] = needed + sizing.GIB
    assert audit.memory_headroom(facts, plan)["status"] == "ok"
    facts["memory"]["available_bytes"] = needed - sizing.GIB  # a neighbour took 2 GiB
    row = audit.memory_headroom(facts, plan)
    assert row["status"] == "drift" and "throttled or OOM-killed" in row["why"]
    assert row["current"]["other_processes_bytes"] == plan["memory"]["total_bytes"] - (needed - sizing.GIB)
    # What the workers hold themselves is theirs to use, not pressure.
    facts["limits"]["vlserve_slice_bytes"] = 2 * sizing.GIB
    assert audit.memory_headroom(facts, plan)["status"] == "ok"


def self_signed(directory: pathlib.Path, days: int) -> str:
    """A front's PEM as the roles install it: the certificate, then its private key."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", str(days), "-subj", "/CN=front"],
        check=True, capture_output=True,
    )  # fmt: skip
    ends = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate", "-dateopt", "iso_8601", "-in", str(cert)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return cert.read_text() + key.read_text(), ends.split("=", 1)[1].strip()


@pytest.mark.parametrize("days", [400, 10, 20000])  # 20000 days: past 2050, a GeneralizedTime
def test_each_front_certificate_shows_its_end_and_drifts_within_the_renewal_margin(root, tmp_path, days):
    pem, ends = self_signed(tmp_path, days)
    write(root, contract.FRONT_PEM, pem)
    write(root, contract.FLEET_CLIENT_PEM, "not a certificate\n")
    tuning = audit.probe_tuning(str(root))
    assert tuning["certificates"][contract.FRONT_PEM] == calendar.timegm(time.strptime(ends, "%Y-%m-%d %H:%M:%SZ"))
    assert set(tuning["certificates"]) == {contract.FRONT_PEM, contract.FLEET_CLIENT_PEM}  # no fleet.pem here
    rows = {row["current"]["file"]: row for row in audit.certificates(tuning)}
    front = rows[contract.FRONT_PEM]
    assert front["current"]["not_after"] == ends[:10] and abs(front["current"]["days_left"] - days) <= 1
    assert front["status"] == ("drift" if days < contract.CERTIFICATE_RENEW_DAYS else "ok"), front
    assert rows[contract.FLEET_CLIENT_PEM]["status"] == "drift"  # unreadable: said, not skipped
    later = dict(tuning, probed_at=tuning["probed_at"] + (days + 1) * 86400)
    expired = {row["current"]["file"]: row for row in audit.certificates(later)}[contract.FRONT_PEM]
    assert expired["status"] == "drift" and "expired" in expired["why"]
