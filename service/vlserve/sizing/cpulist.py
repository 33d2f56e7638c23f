"""Kernel CPU lists ("0-3,8,10-11"), as cgroups, sysfs and systemd's AllowedCPUs= write them."""

from __future__ import annotations


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
