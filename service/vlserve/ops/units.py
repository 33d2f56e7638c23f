"""What the unit templates (templates/ in the repository) are rendered from: the plan and the deploy options.

One function builds the template context for both renderers: the vlserve_deploy role (through
the `vlserve_units_context` filter) and `vlserve render-units` (for hosts without Ansible).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from vlserve.ops.clients import MAX_AUTHORIZATION_CHARS, front_clients
from vlserve.sizing.contract import (
    FLEET_BACKEND_CA,
    FLEET_CLIENT_CN,
    FLEET_CLIENT_PEM,
    FLEET_CLIENTS_CA,
    FLEET_PEM,
    FRONT_PEM,
    FRONT_PUBLIC_CERTIFICATE,
    MONITORING_CLIENT_CN,
    REQUEST_ID,
    TLS_DIR,
)

CONFIG_DIR = "/etc/vlserve"
UNIT_DIR = "/etc/systemd/system"
# Files rendered from templates/, and where each goes on the host: the one list both renderers (the
# deploy role through `vlserve_units.files`, `render_all` here) write from.
UNIT_FILES = {
    "vlserve@.service.j2": UNIT_DIR + "/vlserve@.service",
    "vlserve.target.j2": UNIT_DIR + "/vlserve.target",
    "vlserve-front.service.j2": UNIT_DIR + "/vlserve-front.service",
}
CONFIG_FILES = {
    "vlserve.env.j2": CONFIG_DIR + "/vlserve.env",
    "haproxy.cfg.j2": CONFIG_DIR + "/haproxy.cfg",
    "clients.map.j2": CONFIG_DIR + "/clients.map",
}
# Files only the front's user may read (owner root, group haproxy, 0640): the clients' digests and
# limits, the front's certificate with its private key. Every other file is 0644.
PRIVATE_FILES = {CONFIG_DIR + "/clients.map", CONFIG_DIR + "/fleet-clients.map"}
# The fronts' TLS files (sizing/contract.py names them for the audit too). With a fleet front, a
# host front answers on TCP only to the fleet front's client certificate, and on LOCAL_SOCKET to
# the host itself (the play's own test question, the audit).
LOCAL_SOCKET = "/run/vlserve-front/local.sock"
# Per plan worker: its environment and its systemd drop-in (CPUs, memory limits).
WORKER_FILES = {
    "worker.env.j2": CONFIG_DIR + "/worker-{index}.env",
    "worker.conf.j2": UNIT_DIR + "/vlserve@{index}.service.d/50-plan.conf",
}
# The plan itself, as `vlserve plan --json` prints it, for the workers' status page (read per request:
# a new plan there restarts nothing).
PLAN_FILE = CONFIG_DIR + "/plan.json"
# A fleet front (inventory group vlserve_front): one HAProxy over every service host's front.
FLEET_FILES = {
    "fleet-haproxy.cfg.j2": CONFIG_DIR + "/fleet-haproxy.cfg",
    "clients.map.j2": CONFIG_DIR + "/fleet-clients.map",
    "vlserve-fleet.service.j2": UNIT_DIR + "/vlserve-fleet.service",
}
FLEET_BACKEND = "vlserve_fleet"  # the backend whose servers the rollout drains and enables, one per host
FLEET_SOCKET = "/run/vlserve-fleet/admin.sock"  # HAProxy's runtime API, level admin
# Each host's state in the fleet front (drained, in maintenance, weight), saved by the unit before a
# reload or a stop and read back at start: a host the rollout or the operator drained stays drained.
FLEET_STATE_FILE = "/var/lib/vlserve-fleet/server-state"
FLEET_PEERS = "vlserve_fleet_peers"  # the peers section of several fleet fronts
# The front's own errors (HAProxy's http-error lines in its configuration): the service's error
# shape, and the headers a client acts on.
ERROR_PAGES = {
    400: ("the request is malformed", "invalid_request_error", "bad_request", {}),
    401: (
        "missing or wrong API key (Authorization: Bearer <key>)",
        "authentication_error",
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    ),
    403: ("this API key may not use the model the request names", "permission_error", "model_not_allowed", {}),
    413: ("the request body is over the upload limit", "invalid_request_error", "request_too_large", {}),
    503: ("no worker is ready; try again shortly", "service_unavailable", "no_worker_ready", {"Retry-After": "5"}),
    504: ("the worker did not answer in time", "timeout_error", "timeout", {}),
}

# A client over one of its limits (ops/clients.py): 429 with Retry-After, in the same error shape.
LIMIT_REFUSALS = {
    "concurrent": ("this API key has its most requests in flight; retry when one ends", "concurrency_limit"),
    "requests_per_minute": ("this API key is over its requests per minute", "rate_limit"),
    "tokens_per_minute": (
        "this API key is over its tokens per minute (each request reserves its max_tokens)",
        "token_limit",
    ),
}
LOOPBACK = ("127.", "::1", "localhost")


def error_body(message: str, kind: str, code: str) -> str:
    """The service's one error shape, as the front's own refusals send it."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def exposure_problem(front: dict[str, Any]) -> str | None:
    """Why a front may not listen where it is told to, or None: beyond loopback it needs TLS and keys,
    unless the operator opened it on purpose (`insecure`)."""
    if front["insecure"] or str(front["bind"]).startswith(LOOPBACK):
        return None
    missing = [what for what, present in (("TLS", front["tls"]), ("API keys", front["clients"])) if not present]
    if not missing:
        return None
    return "the front would answer on %s:%d without %s; give %s, bind it to 127.0.0.1, or mark it insecure" % (
        front["bind"],
        front["port"],
        " and ".join(missing),
        " and ".join(missing),
    )


def _front(options: dict[str, Any], prefix: str, pem: str, clients_map: str) -> dict[str, Any]:
    """What both fronts' templates share: where they listen, TLS, the clients, the limits' refusals."""
    tls = _truthy(options.get(prefix + "tls", False))
    return {
        "port": int(options[prefix + "port"]),
        "bind": options[prefix + "bind"],
        "tls": {"pem": pem} if tls else None,
        "insecure": _truthy(options.get(prefix + "insecure", False)),
        "clients": front_clients(options.get("clients") or [], "clients"),
        "clients_map": clients_map,
        "max_authorization_chars": MAX_AUTHORIZATION_CHARS,
        "request_id_pattern": REQUEST_ID,
        "peers": None,  # a fleet front's, where there are several (fleet_context)
        "metrics": _metrics(options, prefix, tls),
        "state_file": None,  # a fleet front's (fleet_context)
        # What a request that names no max_tokens reserves against a tokens-per-minute limit.
        "default_max_tokens": int((options.get("settings") or {}).get("max_tokens_default", 512)),
        "max_upload_bytes": int(options["max_upload_bytes"]),
        "timeout_s": int(options["request_timeout_s"]) + 30,
        "refusals": {
            name: error_body(message, "rate_limit_error", code) for name, (message, code) in LIMIT_REFUSALS.items()
        },
    }


def units_context(plan: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The `vlserve_units` variable of the templates.

    `options`: the vlserve_deploy role's variables without their prefix (install_dir, user, group,
    model_dir, state_dir, cache_dir, front_port, front_bind, front_tls, front_insecure, clients,
    settings, ...).
    """
    install_dir = str(options["install_dir"])
    merged = {
        "max_upload_bytes": int(options["max_upload_bytes"]),
        "request_timeout_s": int(options["request_timeout_s"]),
        **options.get("settings", {}),
    }
    settings = {"VLSERVE_%s" % name.upper(): _env_value(value) for name, value in sorted(merged.items())}
    return {
        "model_name": plan["model"]["name"],
        "served_model_name": options["served_model_name"],
        "install_dir": install_dir,
        "venv": install_dir + "/current/venv",  # the current release's (the deploy role switches the link)
        "user": options["user"],
        "group": options["group"],
        "config_dir": CONFIG_DIR,
        "plan_file": PLAN_FILE,
        "files": {"units": UNIT_FILES, "config": CONFIG_FILES, "worker": WORKER_FILES},
        "model_dir": str(options["model_dir"]),
        "state_dir": str(options["state_dir"]),
        "cache_dir": str(options["cache_dir"]),
        "native_kernels": "%s/kernels" % options["cache_dir"] if options.get("native_kernels", True) else "off",
        # The deploy role builds them before any worker starts (vlserve kernels); render-units' hosts
        # have no such step, so their first worker builds them.
        "kernels_build": not options.get("kernels_prebuilt", False),
        "start_timeout_s": int(options["start_timeout_s"]),
        "image_url_hosts": list(options.get("settings", {}).get("image_url_hosts", [])),
        "settings": settings,
        "numa_bind": plan["workers"]["numa_bind"],
        "workers": [
            dict(worker, files={name: path.format(index=worker["index"]) for name, path in WORKER_FILES.items()})
            for worker in plan["worker_list"]
        ],
        "worker_bind": options.get("worker_bind", "127.0.0.1"),
        "fleet": {"backend": FLEET_BACKEND, "socket": FLEET_SOCKET},  # where a fleet front drains this host
        "front": dict(
            _front(options, "front_", FRONT_PEM, CONFIG_FILES["clients.map.j2"]),
            # Where this host reaches its own front (checks, the play's test question).
            local_address="127.0.0.1" if options["front_bind"] in ("0.0.0.0", "::") else options["front_bind"],
            fleet_only=_fleet_only(options),
            # Its certificate chain alone, readable by the workers (their expiry metric).
            public_certificate=FRONT_PUBLIC_CERTIFICATE,
        ),
        "error_pages": _error_pages(),
    }


def _metrics(options: dict[str, Any], prefix: str, tls: bool) -> dict[str, Any] | None:
    """The port Prometheus scrapes a front on (its own metrics and, on a host, each worker's), where a
    monitoring host exists: over TLS, to the monitoring host's client certificate alone."""
    if not _truthy(options.get(prefix + "metrics", False)):
        return None
    return {
        "port": int(options[prefix + "metrics_port"]),
        "ca": FLEET_CLIENTS_CA if tls else None,
        "client_cn": MONITORING_CLIENT_CN,
        "refusal": error_body("the metrics answer only the monitoring host", "permission_error", "monitoring_only"),
    }


def _fleet_only(options: dict[str, Any]) -> dict[str, Any] | None:
    """Behind a fleet front, a host front serves TCP only to the fleet front's client certificate
    (mutual TLS: an address can be shared behind NAT or spoofed on a LAN, a key cannot) and its own
    host on a local socket. Needs TLS: without it there is nothing to verify a client with."""
    if not (_truthy(options.get("front_fleet_only", False)) and _truthy(options.get("front_tls", False))):
        return None
    return {
        "ca": FLEET_CLIENTS_CA,
        "client_cn": FLEET_CLIENT_CN,
        "local_socket": LOCAL_SOCKET,
        "refusal": error_body("this host answers only through the fleet front", "permission_error", "fleet_front_only"),
    }


def _error_pages() -> list[dict[str, Any]]:
    """Each error as its http-error line needs it: the body (single-quoted there, so none of the
    messages may hold a single quote) and its headers as "Name value"."""
    return [
        {
            "status": status,
            "body": error_body(message, kind, code),
            "headers": ["%s %s" % item for item in {"Cache-Control": "no-cache", **headers}.items()],
        }
        for status, (message, kind, code, headers) in ERROR_PAGES.items()
    ]


def host_address(name: str, host: Any, bind_variable: str) -> str:
    """Where other hosts reach a host's front, from the inventory: its vlserve_fleet_address, else the
    address its front binds (`bind_variable`) where that is one address, else its ansible_host."""
    bind = host.get(bind_variable, "0.0.0.0")
    return host.get("vlserve_fleet_address") or (
        bind if bind not in ("0.0.0.0", "::") else host.get("ansible_host", name)
    )


def fleet_backends(hosts: list[str], hostvars: Any) -> list[dict[str, Any]]:
    """One server per service host, from the inventory: where its front listens, and a weight of its
    worker count (its plan's, from this run's vlserve_facts) so least-connections sees its capacity."""
    backends = []
    for name in hosts:
        host = hostvars[name]
        plan = host.get("vlserve_plan") or {}
        backends.append(
            {
                "name": name,
                "address": host_address(name, host, "vlserve_deploy_front_bind"),
                "port": int(host.get("vlserve_deploy_front_port", 8100)),
                # The host's front speaks TLS unless its inventory turned it off (the role's default: on).
                "tls": _truthy(host.get("vlserve_deploy_front_tls", True)),
                "weight": max(1, min(256, int((plan.get("workers") or {}).get("count", 1)))),
            }
        )
    return backends


def fleet_peers(fronts: list[str], hostvars: Any, port: int) -> list[dict[str, Any]]:
    """The fleet fronts that share the clients' counters (HAProxy peers), where there are several: each
    reached on its vlserve_fleet_address, else its ansible_host."""
    if len(fronts) < 2:
        return []
    return [
        {
            "name": name,
            "address": hostvars[name].get("vlserve_fleet_address") or hostvars[name].get("ansible_host", name),
            "port": int(port),
        }
        for name in fronts
    ]


def fleet_context(backends: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
    """The `vlserve_fleet` variable of the fleet front's templates. `options`: the vlserve_front role's
    variables without their prefix (port, bind, tls, insecure, clients, max_upload_bytes,
    request_timeout_s, check_interval_s), and client_certificate: whether it has one for the hosts;
    with several fleet fronts, `peers` (fleet_peers) and `peer_name`, this one's name among them."""
    peers = list(options.get("peers") or [])
    if peers and options.get("peer_name") not in [peer["name"] for peer in peers]:
        raise ValueError("the fleet front %r is not one of its peers %s" % (options.get("peer_name"), peers))
    if peers and not _truthy(options.get("client_certificate", False)):
        raise ValueError("fleet fronts share their counters over mutual TLS: they need their client certificates")
    front = _front(options, "", FLEET_PEM, FLEET_FILES["clients.map.j2"])
    return {
        "config_dir": CONFIG_DIR,
        "files": FLEET_FILES,
        "backend": FLEET_BACKEND,
        "socket": FLEET_SOCKET,
        "backends": backends,
        "tls_dir": TLS_DIR,
        "backend_ca": FLEET_BACKEND_CA,  # what the host fronts' certificates are checked against
        # The client certificate it shows the host fronts (mutual TLS), where it has one.
        "client_pem": FLEET_CLIENT_PEM if _truthy(options.get("client_certificate", False)) else None,
        "client_cn": FLEET_CLIENT_CN,  # its name starts so
        "front": dict(
            front,
            check_interval_s=int(options["check_interval_s"]),
            state_file=FLEET_STATE_FILE,
            # Several fleet fronts push each client's counters to one another (HAProxy peers, over
            # mutual TLS with their client certificates): a standby taking over keeps them, and fronts
            # answering side by side see each other's requests (the last update wins: a shared count
            # for requests that follow one another, approximate for simultaneous ones).
            peers={
                "section": FLEET_PEERS,
                "local": options["peer_name"],
                "bind": front["bind"],
                "port": next(peer["port"] for peer in peers if peer["name"] == options["peer_name"]),
                "members": peers,
                "ca": FLEET_CLIENTS_CA,
            }
            if peers
            else None,
        ),
        "error_pages": _error_pages(),
    }


def _truthy(value: Any) -> bool:
    """An inventory boolean, which may reach Python as a string ("false", "no")."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _env_value(value: Any) -> str:
    """A setting as an EnvironmentFile= value: lists as JSON (what pydantic-settings reads), booleans lowercase."""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def comment(text: str) -> str:
    """Ansible's `comment` filter in its default style, for renders without Ansible."""
    return "#\n" + "\n".join(("# " + line).rstrip() for line in text.splitlines()) + "\n#"


def _environment(templates: pathlib.Path):
    """Jinja2 as Ansible's template module runs it here: strict, trailing newlines kept, blocks trimmed."""
    import jinja2  # noqa: PLC0415

    from vlserve.sizing import format_cpu_list  # noqa: PLC0415

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
    )
    environment.filters.update(vlserve_cpu_list=format_cpu_list, comment=comment)
    return environment


def render_fleet(templates: pathlib.Path, context: dict[str, Any], managed: str) -> dict[str, str]:
    """Every file of a fleet front, path -> text, from the same templates the vlserve_front role renders."""
    environment = _environment(templates)
    base = {"vlserve_fleet": context, "ansible_managed": managed}
    return {path: environment.get_template(name).render(base) for name, path in context["files"].items()}


def render_all(templates: pathlib.Path, context: dict[str, Any], managed: str) -> dict[str, str]:
    """Every file of the deployment, path -> text, rendered from the templates with Jinja2."""
    environment = _environment(templates)
    base = {"vlserve_units": context, "ansible_managed": managed}
    files = {}
    for name, destination in {**UNIT_FILES, **CONFIG_FILES}.items():
        files[destination] = environment.get_template(name).render(base)
    for worker in context["workers"]:
        for name, destination in worker["files"].items():
            files[destination] = environment.get_template(name).render(dict(base, worker=worker))
    return files
