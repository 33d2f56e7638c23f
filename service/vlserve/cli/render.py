"""`vlserve render-units` and `render-fleet`: the roles' files for hosts without Ansible."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from vlserve import sizing
from vlserve.cli.common import (
    BadInput,
    add_policy_flags,
    load_facts,
    policy_from_args,
)
from vlserve.sizing.contract import FLEET_CLIENT_CN, MONITORING_CLIENT_CN

# The package's data: in a checkout, links to the repository's templates/ and the two roles' defaults;
# in the wheel (scripts/release), copies of them. So these commands work from an installed release.
DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
TEMPLATES = DATA / "templates"
DEPLOY_DEFAULTS = DATA / "deploy-defaults.yml"
FRONT_DEFAULTS = DATA / "front-defaults.yml"


MANAGED = "Managed by vlserve render-units: local changes will be overwritten."


def _role_defaults(path: pathlib.Path, prefix: str) -> dict:
    """A role's defaults without their prefix: the options the roles and these commands share."""
    import yaml  # noqa: PLC0415

    return {k[len(prefix) :]: v for k, v in yaml.safe_load(path.read_text()).items()}


def _write_tree(out: str, files: dict[str, str], private: set[str]) -> None:
    """The files under `out`; those in `private` (keys' digests, the TLS key) 0640, never readable by
    others, as the roles write them (where this runs as root, chgrp them to haproxy on the host)."""
    for path, text in sorted(files.items()):
        target = pathlib.Path(out) / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o640 if path in private else 0o644
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(descriptor, mode)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        print(target)


def _front_options(args: argparse.Namespace, options: dict, prefix: str, pem: str) -> dict[str, str]:
    """The front's TLS, keys and exposure from the flags -> options; returns the extra files (the PEM)."""
    from vlserve.cli.keys import read_clients  # noqa: PLC0415

    # The flags alone decide (the roles' defaults for these are Ansible expressions).
    options["clients"] = read_clients(args.clients) if args.clients else []
    options[prefix + "insecure"] = bool(args.insecure)
    options[prefix + "tls"] = bool(args.tls_pem)
    extra = {pem: _read_pem(args.tls_pem)} if args.tls_pem else {}
    options[prefix + "metrics"] = args.metrics_port is not None
    if args.metrics_port is not None:
        options[prefix + "metrics_port"] = args.metrics_port
        if args.tls_pem and not args.monitoring_ca:
            raise BadInput(
                "--metrics-port with --tls-pem needs --monitoring-ca: it answers the monitoring host's certificate"
            )
    if args.monitoring_ca:
        from vlserve.ops.units import FLEET_CLIENTS_CA  # noqa: PLC0415

        extra[FLEET_CLIENTS_CA] = _read_pem(args.monitoring_ca, key=False)
    return extra


def _one_clients_ca(extra: dict[str, str], path: str, text: str, flag: str) -> None:
    """The fleet front's, the peers' and the monitoring host's client certificates share one CA file."""
    if extra.get(path, text) != text:
        raise BadInput(
            "%s and --monitoring-ca must name the same CA: the front checks every client certificate against one" % flag
        )
    extra[path] = text


def _read_pem(path: str, key: bool = True) -> str:
    """The front's certificate (chain) and private key in one PEM file, as HAProxy's `crt` takes it
    (without `key`: certificates alone, a CA bundle)."""
    try:
        text = pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput("cannot read the TLS file %s: %s" % (path, getattr(error, "strerror", None) or error)) from None
    if "-----BEGIN CERTIFICATE-----" not in text or key != ("PRIVATE KEY-----" in text):
        raise BadInput(
            "the TLS file %s must hold %s"
            % (path, "the certificate and its private key (PEM, one file)" if key else "certificates only (PEM)")
        )
    return text


def cmd_render_units(args: argparse.Namespace) -> int:
    """The deploy role's files, rendered from the same templates and context, for hosts without Ansible."""
    from vlserve.ops.units import (  # noqa: PLC0415
        FLEET_CLIENTS_CA,
        FRONT_PEM,
        PLAN_FILE,
        PRIVATE_FILES,
        exposure_problem,
        render_all,
        units_context,
    )

    facts = load_facts(args.facts)
    try:
        policy = policy_from_args(args)
    except ValueError as error:
        raise BadInput("invalid policy: %s" % error) from None
    try:
        result = sizing.plan(facts, policy)
    except sizing.PlanError as error:
        print("vlserve render-units: %s" % error, file=sys.stderr)
        return 1
    options = _role_defaults(DEPLOY_DEFAULTS, "vlserve_deploy_")
    for name in ("model_dir", "front_port", "front_bind", "user", "install_dir"):
        if getattr(args, "deploy_" + name) is not None:
            options[name] = getattr(args, "deploy_" + name)
    extra = _front_options(args, options, "front_", FRONT_PEM)
    options["front_fleet_only"] = bool(args.fleet_ca)
    if args.fleet_ca:
        if not args.tls_pem:
            raise BadInput("--fleet-ca needs --tls-pem: the front checks the fleet front's certificate over TLS")
        _one_clients_ca(extra, FLEET_CLIENTS_CA, _read_pem(args.fleet_ca, key=False), "--fleet-ca")
    context = units_context(result, options)
    problem = exposure_problem(context["front"])
    if problem:
        raise BadInput(problem + " (--tls-pem, --clients, --front-bind, --insecure)")
    files = render_all(pathlib.Path(args.templates), context, MANAGED)
    _write_tree(args.out, files | extra | {PLAN_FILE: sizing.dumps(result) + "\n"}, PRIVATE_FILES | {FRONT_PEM})
    print(
        "%d worker(s); copy the tree to / on the host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve.target" % len(result["worker_list"]),
        file=sys.stderr,
    )
    return 0


def _backend(text: str) -> dict:
    """NAME=ADDRESS:PORT[:WEIGHT], one service host behind a fleet front."""
    name, _, where = text.partition("=")
    parts = where.split(":")
    if not name or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError("expected NAME=ADDRESS:PORT[:WEIGHT], not %r" % text)
    return {
        "name": name,
        "address": parts[0],
        "port": int(parts[1]),
        "weight": int(parts[2]) if len(parts) > 2 else 1,
        "tls": False,  # --backend-ca turns it on for every host
    }


def _peer(text: str) -> dict:
    """NAME=ADDRESS:PORT, one fleet front among several."""
    name, _, where = text.partition("=")
    address, _, port = where.rpartition(":")
    if not name or not address or not port.isdigit():
        raise argparse.ArgumentTypeError("expected NAME=ADDRESS:PORT, not %r" % text)
    return {"name": name, "address": address, "port": int(port)}


def cmd_render_fleet(args: argparse.Namespace) -> int:
    """The vlserve_front role's files for a fleet front, from the same templates and context."""
    from vlserve.ops.units import (  # noqa: PLC0415
        FLEET_BACKEND_CA,
        FLEET_CLIENT_PEM,
        FLEET_CLIENTS_CA,
        FLEET_PEM,
        PRIVATE_FILES,
        exposure_problem,
        fleet_context,
        render_fleet,
    )

    options = _role_defaults(FRONT_DEFAULTS, "vlserve_front_")
    for name in ("port", "bind", "check_interval_s"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    extra = _front_options(args, options, "", FLEET_PEM)
    backends = args.backend
    if args.backend_ca:
        extra[FLEET_BACKEND_CA] = _read_pem(args.backend_ca, key=False)
        backends = [dict(backend, tls=True) for backend in backends]
    options["client_certificate"] = bool(args.client_pem)
    if args.client_pem:
        if not args.backend_ca:
            raise BadInput("--client-pem needs --backend-ca: the fleet front shows it to hosts it reaches over TLS")
        extra[FLEET_CLIENT_PEM] = _read_pem(args.client_pem)
    if args.peer:
        if not (args.client_pem and args.peers_ca and args.peer_name):
            raise BadInput("--peer needs --peer-name, --client-pem and --peers-ca: peers speak mutual TLS")
        options["peers"], options["peer_name"] = args.peer, args.peer_name
        _one_clients_ca(extra, FLEET_CLIENTS_CA, _read_pem(args.peers_ca, key=False), "--peers-ca")
    try:
        context = fleet_context(backends, options)
    except ValueError as error:
        raise BadInput(str(error)) from None
    problem = exposure_problem(context["front"])
    if problem:
        raise BadInput(problem + " (--tls-pem, --clients, --bind, --insecure)")
    files = render_fleet(pathlib.Path(args.templates), context, MANAGED)
    _write_tree(args.out, files | extra, PRIVATE_FILES | {FLEET_PEM, FLEET_CLIENT_PEM})
    print(
        "%d host(s) behind port %d; copy the tree to / on the front host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve-fleet.service" % (len(args.backend), context["front"]["port"]),
        file=sys.stderr,
    )
    return 0


def _add_front_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--clients",
        metavar="FILE",
        help="the API's client keys (YAML, see `vlserve keys`): the front holds their digests",
    )
    parser.add_argument(
        "--tls-pem", dest="tls_pem", metavar="FILE", help="the front's certificate chain and private key, one PEM file"
    )
    parser.add_argument(
        "--metrics-port",
        dest="metrics_port",
        type=int,
        metavar="PORT",
        help="open a port for Prometheus: HAProxy's metrics at /metrics/front (and each worker's at /metrics/worker/N)",
    )
    parser.add_argument(
        "--monitoring-ca",
        dest="monitoring_ca",
        metavar="FILE",
        help="the CA (PEM) of the monitoring host's client certificate, whose name starts with %r: over TLS the "
        "metrics port answers it alone" % MONITORING_CLIENT_CN,
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="let the front answer beyond loopback without TLS or keys (trusted networks only)",
    )


def add_commands(commands) -> None:
    """Add render-units and render-fleet to the parser's commands."""
    render = commands.add_parser(
        "render-units", help="write the systemd units and front config for this host's plan (no Ansible needed)"
    )
    render.add_argument("--out", required=True, help="directory to write the file tree into (mirrors /)")
    render.add_argument("--facts", metavar="FILE", help="facts JSON to plan for (default: probe this host)")
    render.add_argument("--templates", default=str(TEMPLATES), help="the templates directory (default: %(default)s)")
    render.add_argument("--model", dest="deploy_model_dir", help="checkpoint directory on the host")
    render.add_argument("--front-port", dest="deploy_front_port", type=int, help="port of the front")
    render.add_argument("--front-bind", dest="deploy_front_bind", help="address the front listens on")
    _add_front_flags(render)
    render.add_argument(
        "--fleet-ca",
        dest="fleet_ca",
        metavar="FILE",
        help="behind a fleet front: answer on TCP only to a client certificate from this CA (PEM) whose name "
        "starts with %r, and to this host on a local socket" % FLEET_CLIENT_CN,
    )
    render.add_argument("--user", dest="deploy_user", help="user the workers run as")
    render.add_argument("--install-dir", dest="deploy_install_dir", help="where the service's venv is")
    add_policy_flags(render)
    render.set_defaults(handler=cmd_render_units)

    fleet = commands.add_parser(
        "render-fleet", help="write a fleet front's HAProxy config and unit (no Ansible needed)"
    )
    fleet.add_argument("--out", required=True, help="directory to write the file tree into (mirrors /)")
    fleet.add_argument(
        "--backend",
        type=_backend,
        action="append",
        required=True,
        metavar="NAME=ADDRESS:PORT[:WEIGHT]",
        help="a service host's front; repeat per host (weight: its worker count)",
    )
    fleet.add_argument("--port", type=int, help="port of the fleet front")
    fleet.add_argument("--bind", help="address the fleet front listens on")
    _add_front_flags(fleet)
    fleet.add_argument("--check-interval-s", dest="check_interval_s", type=int, help="seconds between health checks")
    fleet.add_argument(
        "--backend-ca",
        dest="backend_ca",
        metavar="FILE",
        help="the CA (PEM) that signed the hosts' fronts: the fleet front reaches them over TLS, checked against it",
    )
    fleet.add_argument(
        "--client-pem",
        dest="client_pem",
        metavar="FILE",
        help="the fleet front's client certificate and key (one PEM) for hosts rendered with --fleet-ca",
    )
    fleet.add_argument(
        "--peer",
        type=_peer,
        action="append",
        metavar="NAME=ADDRESS:PORT",
        help="with several fleet fronts: each one (this one too), which share the clients' counters",
    )
    fleet.add_argument("--peer-name", dest="peer_name", metavar="NAME", help="this fleet front's name among --peer")
    fleet.add_argument(
        "--peers-ca",
        dest="peers_ca",
        metavar="FILE",
        help="the CA (PEM) of the fleet fronts' client certificates, which they show one another",
    )
    fleet.add_argument("--templates", default=str(TEMPLATES), help="the templates directory (default: %(default)s)")
    fleet.set_defaults(handler=cmd_render_fleet)
