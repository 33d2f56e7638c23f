"""The host audit: for every tuning knob of the plan, where the host stands (ok, drift, n/a).

`probe_tuning(root)` reads what the tuning roles write (and what the kernel runs with);
`audit(facts, plan, tuning)` compares it with the plan, a pure function. Like the sizing package, this
file is shipped to targets as Ansible module_utils: standard library only, one file.
"""

from __future__ import annotations

import configparser
import glob
import os
import re
import shutil
import time
from typing import Any

try:  # In the vlserve package, and as Ansible module_utils next to vlserve_sizing.
    from vlserve import sizing
except ImportError:  # pragma: no cover - on targets
    from ansible.module_utils import vlserve_sizing as sizing

AUDIT_SCHEMA = "vlserve.ops.audit/1"
# What the tuning roles write, and so what the audit reads back: the roles take these paths from
# the vlserve_facts role (`vlserve_tuning_files`), so both sides name each file once, here.
TUNING_FILES = {
    "sysctl": "/etc/sysctl.d/90-vlserve.conf",
    "zram_config": "/etc/systemd/zram-generator.conf",
    "zram_unit": "/etc/systemd/system/vlserve-zram.service",  # the zramctl fallback
    # Where tuned runs, the sysctl values live in a tuned profile: tuned 2.23 and later (Debian 13,
    # Fedora 40) read user profiles from /etc/tuned/profiles, older ones from /etc/tuned.
    "tuned_profile": "/etc/tuned/vlserve/tuned.conf",
    "tuned_profile_2_23": "/etc/tuned/profiles/vlserve/tuned.conf",
    "slice_unit": "/etc/systemd/system/vlserve.slice",
    "governor_unit": "/etc/systemd/system/vlserve-cpu-governor.service",
    "wsl_conf": "/etc/wsl.conf",
}
SYSCTL_FILE = TUNING_FILES["sysctl"]
ZRAM_CONFIG = TUNING_FILES["zram_config"]
ZRAM_UNIT = TUNING_FILES["zram_unit"]
TUNED_PROFILES = (TUNING_FILES["tuned_profile_2_23"], TUNING_FILES["tuned_profile"])
SLICE_UNIT = TUNING_FILES["slice_unit"]
GOVERNOR_UNIT = TUNING_FILES["governor_unit"]
WSL_CONF = TUNING_FILES["wsl_conf"]
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib/*-linux-gnu", "/lib/*-linux-gnu")


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/")), encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _ini(text: str | None) -> configparser.ConfigParser | None:
    if text is None:
        return None
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys keep their case (AllowedCPUs)
    try:
        parser.read_string(text)
    except configparser.Error:
        return None
    return parser


def _sysctl_file(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    values = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def _zram_unit(text: str | None) -> dict[str, str] | None:
    """The zramctl unit's size and algorithm, in the generator's terms."""
    if text is None:
        return None
    size = re.search(r"zramctl /dev/zram0 --size (\d+)M", text)
    algorithm = re.search(r"--algorithm (\S+)", text)
    if not size or not algorithm:
        return None
    return {"zram-size": size.group(1), "compression-algorithm": algorithm.group(1)}


def _tuned_sysctl(text: str | None) -> dict[str, str] | None:
    profile = _ini(text)
    if profile is None or not profile.has_section("sysctl"):
        return None
    return dict(profile["sysctl"])


def probe_tuning(root: str = "/") -> dict[str, Any]:
    """What the tuning roles have written on this host, read back from the files themselves."""
    zram = _ini(_read(root, ZRAM_CONFIG))
    slice_unit = _ini(_read(root, SLICE_UNIT))
    wsl = _ini(_read(root, WSL_CONF))
    effective = _read(root, "/sys/fs/cgroup/vlserve.slice/cpuset.cpus.effective")
    libgomp = any(glob.glob(os.path.join(root, directory.lstrip("/"), "libgomp.so.1")) for directory in LIBRARY_DIRS)
    return {
        "sysctl_file": _sysctl_file(_read(root, SYSCTL_FILE))
        or next((found for path in TUNED_PROFILES if (found := _tuned_sysctl(_read(root, path)))), None),
        "zram_config": dict(zram["zram0"])
        if zram is not None and zram.has_section("zram0")
        else _zram_unit(_read(root, ZRAM_UNIT)),
        "slice": {
            "allowed_cpus": sizing.parse_cpu_list(slice_unit.get("Slice", "AllowedCPUs", fallback=""))
            if slice_unit is not None
            else None,
            "effective_cpus": sizing.parse_cpu_list(effective) if effective and effective.strip() else None,
        },
        "governor_unit": os.path.exists(os.path.join(root, GOVERNOR_UNIT.lstrip("/"))),
        "wsl_systemd": wsl.get("boot", "systemd", fallback=None) if wsl is not None else None,
        "libgomp": libgomp,
        "numactl": shutil.which("numactl") is not None
        if root == "/"
        else os.path.exists(os.path.join(root, "usr/bin/numactl")),
        "certificates": {
            path: sizing.certificates.not_after(_read(root, path))
            for path in sizing.contract.FRONT_CERTIFICATES
            if os.path.exists(os.path.join(root, path.lstrip("/")))
        },
        "probed_at": int(time.time()),
    }


def _row(knob: str, current: Any, desired: Any, status: str, why: str) -> dict[str, Any]:
    return {"knob": knob, "current": current, "desired": desired, "status": status, "why": why}


def _status(knob: dict[str, Any], running_ok: bool | None, written_ok: bool | None) -> tuple[str, str]:
    """ok / drift / n/a from what runs (where the knob applies) and what is written (where it is configured)."""
    if not knob["configure"]:
        return "n/a", knob["why"]
    checks = [ok for ok in (running_ok, written_ok) if ok is not None]
    return ("ok" if all(checks) else "drift"), knob["why"]


def running_checks(facts: dict[str, Any], plan: dict[str, Any], tuning: dict[str, Any]) -> dict[str, bool | None]:
    """Per knob: does what runs now match the plan? None where the knob does not take effect here.

    The one place that decides runtime drift: the audit reports it, and the roles act on
    `runtime_drift` (what they re-apply where it differs).
    """
    knobs, sysctl = plan["knobs"], facts["sysctl"]
    zram = knobs["zram"]["value"]
    device = {d["name"]: d for d in facts["memory"]["zram"]["devices"]}.get("zram0")
    swapping = {os.path.basename(s["name"]) for s in facts["memory"]["swaps"]}
    running = {
        "cpu_governor": set(facts["cpufreq"]["governors"]) == {knobs["cpu_governor"]["value"]},
        "energy_performance_preference": set(facts["cpufreq"]["energy_performance_preferences"])
        == {knobs["energy_performance_preference"]["value"]},
        "zram": device is not None
        and "zram0" in swapping
        and abs((device["disksize_bytes"] or 0) - zram["size_bytes"]) <= sizing.MIB
        and device["algorithm"] == zram["algorithm"],
        "swappiness": sysctl.get("vm.swappiness") == knobs["swappiness"]["value"],
        "page_cluster": sysctl.get("vm.page-cluster") == knobs["page_cluster"]["value"],
        "cpu_isolation": tuning["slice"]["effective_cpus"] == knobs["cpu_isolation"]["value"]["cpus"],
        "openmp_runtime": {"libgomp": tuning["libgomp"], "numactl": tuning["numactl"]}
        == knobs["openmp_runtime"]["value"],
        "wsl": None,  # .wslconfig is the Windows side's: nothing to read from here
    }
    return {name: (ok if knobs[name]["applies"] else None) for name, ok in running.items()}


def runtime_drift(facts: dict[str, Any], plan: dict[str, Any], tuning: dict[str, Any]) -> list[str]:
    """The knobs whose running state differs from the plan where they take effect."""
    return [name for name, ok in running_checks(facts, plan, tuning).items() if ok is False]


def audit(facts: dict[str, Any], plan: dict[str, Any], tuning: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per knob of the plan: current value, desired value, ok / drift / n/a, and why."""
    knobs = plan["knobs"]
    running = running_checks(facts, plan, tuning)
    rows = []

    def add(name: str, current: Any, written_ok: bool | None = None, desired: Any = None) -> None:
        status, why = _status(knobs[name], running[name], written_ok)
        rows.append(_row(name, current, knobs[name]["value"] if desired is None else desired, status, why))

    governors = facts["cpufreq"]["governors"]
    add("cpu_governor", sorted(governors) or None, tuning["governor_unit"])
    add("energy_performance_preference", sorted(facts["cpufreq"]["energy_performance_preferences"]) or None)

    wanted = knobs["zram"]["value"]
    device = {d["name"]: d for d in facts["memory"]["zram"]["devices"]}.get("zram0")
    swapping = {os.path.basename(s["name"]) for s in facts["memory"]["swaps"]}
    config = tuning["zram_config"]
    add(
        "zram",
        {"size_bytes": device["disksize_bytes"], "algorithm": device["algorithm"], "swap": "zram0" in swapping}
        if device
        else None,
        config is not None
        and config.get("zram-size") == str(wanted["size_bytes"] // sizing.MIB)
        and config.get("compression-algorithm") == wanted["algorithm"],
    )

    written_sysctl = tuning["sysctl_file"] or {}
    for name, key in (("swappiness", "vm.swappiness"), ("page_cluster", "vm.page-cluster")):
        written = written_sysctl.get(key)
        add(name, {"running": facts["sysctl"].get(key), "sysctl.d": written}, written == str(knobs[name]["value"]))

    knob = knobs["cpu_isolation"]
    state = tuning["slice"]
    shown = state["effective_cpus"] if knob["applies"] else state["allowed_cpus"]
    add(
        "cpu_isolation",
        sizing.format_cpu_list(shown) if shown is not None else None,
        state["allowed_cpus"] == knob["value"]["cpus"],
        desired=sizing.format_cpu_list(knob["value"]["cpus"]),
    )

    add("openmp_runtime", {"libgomp": tuning["libgomp"], "numactl": tuning["numactl"]})
    add("wsl", {"systemd": tuning["wsl_systemd"]}, (tuning["wsl_systemd"] or "").lower() == "true")
    rows.append(memory_headroom(facts, plan))
    rows.extend(certificates(tuning))
    return rows


def certificates(tuning: dict[str, Any]) -> list[dict[str, Any]]:
    """Not knobs either: one row per front certificate on the host, drift within the renewal margin
    (the next play signs the private CA's again; an operator's needs the operator)."""
    rows = []
    margin = sizing.contract.CERTIFICATE_RENEW_DAYS
    for path, not_after in sorted(tuning.get("certificates", {}).items()):
        if not_after is None:
            rows.append(_row("certificate", {"file": path}, {"days_left": ">= %d" % margin}, "drift", "unreadable"))
            continue
        days = (not_after - tuning["probed_at"]) // 86400
        ends = time.strftime("%Y-%m-%d", time.gmtime(not_after))
        why = "%s ends on %s" % (os.path.basename(path), ends)
        if days < margin:
            why += ": %s within %d days; the next play renews one the private CA signed" % (
                "expired" if days < 0 else "ends",
                margin,
            )
        current = {"file": path, "not_after": ends, "days_left": days}
        rows.append(
            _row("certificate", current, {"days_left": ">= %d" % margin}, "ok" if days >= margin else "drift", why)
        )
    return rows


def memory_headroom(facts: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Not a knob but the plan's premise: do the host's other processes leave the workers their memory?

    The plan sizes from stable capacity, so it holds still while neighbours grow; this row is where
    their growth shows, read from what is free now plus what the workers already hold.
    """
    memory, limits = facts["memory"], facts["limits"]
    free = memory["available_bytes"]
    if limits.get("memory_limit_bytes") is not None and limits.get("memory_usage_bytes") is not None:
        free = min(free, limits["memory_limit_bytes"] - limits["memory_usage_bytes"])
    held = limits.get("vlserve_slice_bytes") or 0
    needed = plan["workers"]["count"] * plan["memory"]["per_worker"]["high_bytes"]
    others = max(0, plan["memory"]["total_bytes"] - free - held)
    ok = free + held >= needed
    why = "the plan gives its %d worker(s) %s; other processes use %s of %s, leaving %s" % (
        plan["workers"]["count"],
        _gib(needed),
        _gib(others),
        _gib(plan["memory"]["total_bytes"]),
        _gib(free + held),
    )
    if not ok:
        why += ": the workers will be throttled or OOM-killed at full load (stop something, or declare it"
        why += " with vlserve_facts_other_services_bytes so the plan leaves it room)"
    return _row(
        "memory_headroom",
        {"other_processes_bytes": others, "free_for_workers_bytes": free + held},
        {"workers_bytes": needed},
        "ok" if ok else "drift",
        why,
    )


def render(rows: list[dict[str, Any]]) -> str:
    """A table for people: knob, status, current -> desired, why."""

    def show(value: Any) -> str:
        if isinstance(value, dict):
            return ", ".join("%s=%s" % (k.removesuffix("_bytes"), _short(k, v)) for k, v in value.items())
        return "-" if value is None else str(value)

    width = max(len(r["knob"]) for r in rows)
    lines = ["%s  %-6s %s" % ("knob".ljust(width), "status", "current -> desired  (why)")]
    for row in rows:
        lines.append(
            "%s  %-6s %s -> %s  (%s)"
            % (row["knob"].ljust(width), row["status"], show(row["current"]), show(row["desired"]), row["why"])
        )
    return "\n".join(lines)


def _gib(value: int) -> str:
    return "%.1f GiB" % (value / sizing.GIB)


def _short(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return "%.1fGiB" % (value / sizing.GIB)
    if isinstance(value, list):
        return sizing.format_cpu_list(value) or "none"
    return str(value)


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"ok": 0, "drift": 0, "n/a": 0}
    for row in rows:
        counts[row["status"]] += 1
    return counts


FLEET_SCHEMA = "vlserve.fleet-audit/1"


def fleet_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's audit from each host's report: its plan in one line, its drift and whether it serves."""
    hosts = []
    for report in sorted(reports, key=lambda r: r["host"]):
        plan = report.get("plan")
        shape = None
        if plan:
            threads = "/".join(str(t) for t in plan["workers"]["threads"])
            shape = "%d x %s threads, %s" % (plan["workers"]["count"], threads, plan["model"]["dtype"])
        hosts.append(
            {
                "host": report["host"],
                "plan": shape,
                "plan_error": report.get("plan_error"),
                "drift": (report.get("summary") or {}).get("drift"),
                "drifting": [row["knob"] for row in report.get("knobs", []) if row["status"] == "drift"],
                "serving": report.get("serving"),
            }
        )
    return {
        "schema": FLEET_SCHEMA,
        "hosts": hosts,
        "totals": {
            "hosts": len(hosts),
            "serving": sum(1 for h in hosts if h["serving"] == "ready"),
            "drifting": sum(1 for h in hosts if h["drift"]),
            "without_plan": sum(1 for h in hosts if h["plan"] is None),
        },
    }


def render_fleet(summary: dict[str, Any]) -> str:
    """The fleet summary as a table: host, plan, drift, serving."""
    rows = [("host", "plan", "drift", "serving")]
    for host in summary["hosts"]:
        drift = "-" if host["drift"] is None else str(host["drift"])
        if host["drifting"]:
            drift += " (%s)" % ", ".join(host["drifting"])
        rows.append((host["host"], host["plan"] or "no plan: %s" % host["plan_error"], drift, host["serving"] or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
    totals = summary["totals"]
    lines.append(
        "%d host(s): %d serving, %d drifting, %d without a plan"
        % (totals["hosts"], totals["serving"], totals["drifting"], totals["without_plan"])
    )
    return "\n".join(lines)
