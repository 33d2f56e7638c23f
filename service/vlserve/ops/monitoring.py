"""What Prometheus scrapes, from the inventory: file-based service discovery target groups.

Each service host's front opens a metrics port (templates/haproxy-metrics.j2): its HAProxy's own
metrics at /metrics/front, and each worker's at /metrics/worker/N (workers listen on loopback only).
Each fleet front opens the same port for its HAProxy. One target per worker and per front, labelled
with the host (and worker) it is, over TLS where the host's front speaks it.
"""

from __future__ import annotations

from typing import Any

from vlserve.ops.units import host_address

METRICS_PORT = 9101  # the roles' default (vlserve_deploy_metrics_port, vlserve_front_metrics_port)
FRONT_METRICS_PATH = "/metrics/front"
WORKER_METRICS_PATH = "/metrics/worker/{index}"


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")


def _group(address: str, port: int, tls: bool, path: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "targets": ["%s:%d" % (address, port)],
        "labels": {"__metrics_path__": path, "__scheme__": "https" if tls else "http", **labels},
    }


def _front_target(name: str, host: Any, prefix: str, front_prefix: str) -> tuple[str, int, bool]:
    """Where Prometheus reaches a front's metrics port: address, port, TLS, from the role variables
    with these prefixes ("vlserve_deploy_" and "vlserve_deploy_front_", or "vlserve_front_" twice)."""
    return (
        host_address(name, host, front_prefix + "bind"),
        int(host.get(prefix + "metrics_port", METRICS_PORT)),
        _truthy(host.get(front_prefix + "tls", True)),
    )


def scrape_targets(service_hosts: list[str], fronts: list[str], hostvars: Any) -> dict[str, list[dict[str, Any]]]:
    """{"workers", "fronts", "fleet_fronts"}: the target groups of each scrape job. A service host's
    workers are its plan's (this run's vlserve_facts); a host without a plan yet has its front only."""
    workers, host_fronts, fleet_fronts = [], [], []
    for name in service_hosts:
        host = hostvars[name]
        where = _front_target(name, host, "vlserve_deploy_", "vlserve_deploy_front_")
        host_fronts.append(_group(*where, FRONT_METRICS_PATH, {"host": name, "instance": name + "/front"}))
        for worker in (host.get("vlserve_plan") or {}).get("worker_list", []):
            index = int(worker["index"])
            labels = {"host": name, "worker": str(index), "instance": "%s/worker/%d" % (name, index)}
            workers.append(_group(*where, WORKER_METRICS_PATH.format(index=index), labels))
    for name in fronts:
        where = _front_target(name, hostvars[name], "vlserve_front_", "vlserve_front_")
        fleet_fronts.append(_group(*where, FRONT_METRICS_PATH, {"host": name, "instance": name + "/front"}))
    return {"workers": workers, "fronts": host_fronts, "fleet_fronts": fleet_fronts}
