"""The toolkit's command line: `vlserve probe`, `vlserve plan` (and the service's commands)."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import types
import typing
from dataclasses import fields

from vlserve import __version__, sizing


def _policy_flag_type(annotation):
    """The argparse type for a Policy field, from its annotation."""
    hint = typing.get_type_hints(sizing.Policy)[annotation]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if typing.get_origin(base) in (list, list):
        return sizing.parse_cpu_list
    return base


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Policy field, so the CLI and the planner cannot disagree on what can be set."""
    group = parser.add_argument_group("sizing policy")
    for item in fields(sizing.Policy):
        flag = "--" + item.name.replace("_", "-")
        if item.name == "objective":
            # The issue and the docs call this the policy: `--policy latency|throughput`.
            group.add_argument(
                "--policy",
                dest="objective",
                choices=("throughput", "latency"),
                default=None,
                help=item.metadata["help"] + " (default: throughput)",
            )
            continue
        group.add_argument(
            flag,
            dest=item.name,
            type=_policy_flag_type(item.name),
            default=None,
            metavar=item.name.upper(),
            help=item.metadata["help"],
        )


def _policy_from_args(args: argparse.Namespace) -> sizing.Policy:
    return sizing.Policy.from_mapping({item.name: getattr(args, item.name) for item in fields(sizing.Policy)})


def _load_facts(path: str | None) -> dict:
    if not path:
        return sizing.probe()
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def cmd_probe(args: argparse.Namespace) -> int:
    facts = sizing.probe(root=args.root)
    print(sizing.dumps(facts) if args.json else sizing.render_facts(facts))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    facts = _load_facts(args.facts)
    try:
        policy = _policy_from_args(args)
        sizing.check_policy_fits(facts["limits"], policy)
    except ValueError as error:
        print("vlserve plan: invalid policy: %s" % error, file=sys.stderr)
        return 2
    try:
        result = sizing.plan(facts, policy)
    except sizing.PlanError as error:
        if args.json:
            print(json.dumps({"schema": sizing.PLAN_SCHEMA, "error": str(error)}, indent=2))
        print("vlserve plan: cannot plan %s: %s" % (facts.get("hostname", "this host"), error), file=sys.stderr)
        return 1
    if args.json:
        print(sizing.dumps(result))
    else:
        print(sizing.render_facts(facts))
        print()
        print(sizing.render_plan(result))
    return 0


def _settings_flag(parser: argparse._ArgumentGroup, name: str, info) -> None:
    """One flag for a settings field: its type, choices and description come from the model."""
    base = info.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
        base = next(a for a in typing.get_args(base) if a is not type(None))
    env = "VLSERVE_" + name.upper()
    default = info.default if info.default_factory is None else info.default_factory()
    shown = "" if default is None or (isinstance(default, list) and not default) else " (default: %s)" % default
    text = "%s%s [env %s]" % (info.description, shown, env)
    flag = "--" + name.replace("_", "-")
    if base is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif typing.get_origin(base) is typing.Literal:
        parser.add_argument(flag, dest=name, choices=typing.get_args(base), default=None, help=text)
    elif typing.get_origin(base) is list:
        parser.add_argument(
            flag,
            dest=name,
            type=lambda value: [v for v in value.split(",") if v],
            default=None,
            metavar="A,B",
            help=text,
        )
    else:
        kind = {int: int, float: float}.get(base, str)
        parser.add_argument(flag, dest=name, type=kind, default=None, metavar=name.upper(), help=text)


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    from vlserve.settings import SETTINGS_MODELS  # noqa: PLC0415 - pydantic only for the service commands

    for model in SETTINGS_MODELS:
        group = parser.add_argument_group(model.__name__.removesuffix("Settings").lower() + " settings")
        for name, info in model.model_fields.items():
            _settings_flag(group, name, info)


def cmd_serve(args: argparse.Namespace) -> int:
    import pydantic  # noqa: PLC0415

    from vlserve.settings import SETTINGS_MODELS, Settings  # noqa: PLC0415

    try:
        parts = [
            model(**{name: getattr(args, name) for name in model.model_fields if getattr(args, name) is not None})
            for model in SETTINGS_MODELS
        ]
    except pydantic.ValidationError as error:
        print("vlserve serve: invalid settings:\n%s" % error, file=sys.stderr)
        return 2
    settings = Settings(*parts)
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from vlserve.engine import ModelDirectoryError, check_model_directory  # noqa: PLC0415

    try:
        check_model_directory(settings.model.model)
    except ModelDirectoryError as error:
        logging.getLogger("vlserve").error("cannot start: %s", error)
        from vlserve import notify  # noqa: PLC0415

        notify.status("cannot start: %s" % error)
        return 1
    import uvicorn  # noqa: PLC0415

    from vlserve.app import create_app  # noqa: PLC0415

    holder: dict = {}
    app = create_app(settings, on_fatal=lambda message: setattr(holder["server"], "should_exit", True))
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=30,
    )
    holder["server"] = server = uvicorn.Server(config)
    server.run()
    return 1 if app.state.fatal else 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from vlserve.testmodel import make_test_model  # noqa: PLC0415

    path = make_test_model(args.directory, size=args.size, seed=args.seed, dtype=args.dtype)
    print("wrote a %s Qwen3-VL test checkpoint with random weights to %s" % (args.size, path))
    return 0


REPO_TEMPLATES = pathlib.Path(__file__).resolve().parent.parent.parent / "templates"
DEPLOY_DEFAULTS = (
    pathlib.Path(__file__).resolve().parent.parent.parent / "roles" / "vlserve_deploy" / "defaults" / "main.yml"
)
MANAGED = "Managed by vlserve render-units: local changes will be overwritten."


def cmd_render_units(args: argparse.Namespace) -> int:
    """The deploy role's files, rendered from the same templates and context, for hosts without Ansible."""
    import yaml  # noqa: PLC0415

    from vlserve.units import render_all, units_context  # noqa: PLC0415

    facts = _load_facts(args.facts)
    try:
        policy = _policy_from_args(args)
        result = sizing.plan(facts, policy)
    except (ValueError, sizing.PlanError) as error:
        print("vlserve render-units: %s" % error, file=sys.stderr)
        return 1
    prefix = "vlserve_deploy_"
    options = {k[len(prefix) :]: v for k, v in yaml.safe_load(DEPLOY_DEFAULTS.read_text()).items()}
    for name in ("model_dir", "front_port", "api_key", "user", "install_dir"):
        if getattr(args, "deploy_" + name) is not None:
            options[name] = getattr(args, "deploy_" + name)
    files = render_all(pathlib.Path(args.templates), units_context(result, options), MANAGED)
    out = pathlib.Path(args.out)
    for path, text in sorted(files.items()):
        target = out / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)
    print(
        "%d worker(s); copy the tree to / on the host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve.target" % len(result["worker_list"]),
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlserve", description=__doc__)
    parser.add_argument("--version", action="version", version="vlserve " + __version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    probe = commands.add_parser("probe", help="print the facts the sizing engine sees on this host")
    probe.add_argument("--json", action="store_true", help="print the facts as JSON (schema %s)" % sizing.FACTS_SCHEMA)
    probe.add_argument("--root", default="/", help="read /proc and /sys below this directory (default: /)")
    probe.set_defaults(handler=cmd_probe)

    plan = commands.add_parser("plan", help="print the sizing plan for this host or for captured facts")
    plan.add_argument(
        "--facts", metavar="FILE", help="facts JSON from `vlserve probe --json` (default: probe this host)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (schema %s)" % sizing.PLAN_SCHEMA)
    _add_policy_flags(plan)
    plan.set_defaults(handler=cmd_plan)

    serve = commands.add_parser(
        "serve",
        help="run one inference worker (OpenAI-compatible HTTP API)",
        description="Every setting is also an environment variable (VLSERVE_<NAME>); flags win.",
    )
    _add_settings_flags(serve)
    serve.set_defaults(handler=cmd_serve)

    render = commands.add_parser(
        "render-units", help="write the systemd units and front config for this host's plan (no Ansible needed)"
    )
    render.add_argument("--out", required=True, help="directory to write the file tree into (mirrors /)")
    render.add_argument("--facts", metavar="FILE", help="facts JSON to plan for (default: probe this host)")
    render.add_argument(
        "--templates", default=str(REPO_TEMPLATES), help="the templates directory (default: %(default)s)"
    )
    render.add_argument("--model-dir", dest="deploy_model_dir", help="model directory on the host")
    render.add_argument("--front-port", dest="deploy_front_port", type=int, help="port of the front")
    render.add_argument("--api-key", dest="deploy_api_key", help="API key the front requires")
    render.add_argument("--user", dest="deploy_user", help="user the workers run as")
    render.add_argument("--install-dir", dest="deploy_install_dir", help="where the service's venv is")
    _add_policy_flags(render)
    render.set_defaults(handler=cmd_render_units)

    test_model = commands.add_parser(
        "make-test-model", help="write a Qwen3-VL checkpoint with random weights, offline (tests, benchmarks)"
    )
    test_model.add_argument("directory", help="where to write it")
    test_model.add_argument(
        "--size",
        choices=("tiny", "real"),
        default="tiny",
        help="tiny: ~1 MB for tests; real: the Qwen3-VL-2B-Instruct shape, ~4.3 GB (default: tiny)",
    )
    test_model.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    test_model.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the saved weights (default: bfloat16, as the real checkpoint)",
    )
    test_model.set_defaults(handler=cmd_make_test_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
