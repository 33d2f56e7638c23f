"""`vlserve render-units` and `render-fleet`: the roles' files for hosts without Ansible."""

from __future__ import annotations

import argparse
import pathlib
import sys

from vlserve import sizing
from vlserve.cli.common import (
    BadInput,
    add_policy_flags,
    load_facts,
    policy_from_args,
)

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


def _write_tree(out: str, files: dict[str, str]) -> None:
    for path, text in sorted(files.items()):
        target = pathlib.Path(out) / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)


def cmd_render_units(args: argparse.Namespace) -> int:
    """The deploy role's files, rendered from the same templates and context, for hosts without Ansible."""
    from vlserve.ops.units import PLAN_FILE, render_all, units_context  # noqa: PLC0415

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
    for name in ("model_dir", "front_port", "api_key", "user", "install_dir"):
        if getattr(args, "deploy_" + name) is not None:
            options[name] = getattr(args, "deploy_" + name)
    files = render_all(pathlib.Path(args.templates), units_context(result, options), MANAGED)
    _write_tree(args.out, files | {PLAN_FILE: sizing.dumps(result) + "\n"})
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
    return {"name": name, "address": parts[0], "port": int(parts[1]), "weight": int(parts[2]) if len(parts) > 2 else 1}


def cmd_render_fleet(args: argparse.Namespace) -> int:
    """The vlserve_front role's files for a fleet front, from the same templates and context."""
    from vlserve.ops.units import fleet_context, render_fleet  # noqa: PLC0415

    options = _role_defaults(FRONT_DEFAULTS, "vlserve_front_")
    for name in ("port", "bind", "api_key", "check_interval_s"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    context = fleet_context(args.backend, options)
    _write_tree(args.out, render_fleet(pathlib.Path(args.templates), context, MANAGED))
    print(
        "%d host(s) behind port %d; copy the tree to / on the front host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve-fleet.service" % (len(args.backend), context["front"]["port"]),
        file=sys.stderr,
    )
    return 0


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
    render.add_argument("--api-key", dest="deploy_api_key", help="API key the front requires")
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
    fleet.add_argument("--api-key", dest="api_key", help="API key the fleet front requires")
    fleet.add_argument("--check-interval-s", dest="check_interval_s", type=int, help="seconds between health checks")
    fleet.add_argument("--templates", default=str(TEMPLATES), help="the templates directory (default: %(default)s)")
    fleet.set_defaults(handler=cmd_render_fleet)
