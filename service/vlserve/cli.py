"""The toolkit's command line: `vlserve probe`, `vlserve plan` (and the service's commands)."""

from __future__ import annotations

import argparse
import json
import sys
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
