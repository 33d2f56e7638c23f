"""`vlserve probe` and `vlserve plan`: what the sizing engine sees on a host and what it plans."""

from __future__ import annotations

import argparse
import json
import sys

from vlserve import sizing
from vlserve.cli.common import (
    add_policy_flags,
    load_facts,
    policy_from_args,
)


def cmd_probe(args: argparse.Namespace) -> int:
    facts = sizing.probe(root=args.root)
    print(sizing.dumps(facts) if args.json else sizing.render_facts(facts))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    facts = load_facts(args.facts)
    try:
        policy = policy_from_args(args)
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


def add_commands(commands) -> None:
    """Add probe and plan to the parser's commands."""
    probe = commands.add_parser("probe", help="print the facts the sizing engine sees on this host")
    probe.add_argument("--json", action="store_true", help="print the facts as JSON (schema %s)" % sizing.FACTS_SCHEMA)
    probe.add_argument("--root", default="/", help="read /proc and /sys below this directory (default: /)")
    probe.set_defaults(handler=cmd_probe)

    plan = commands.add_parser("plan", help="print the sizing plan for this host or for captured facts")
    plan.add_argument(
        "--facts", metavar="FILE", help="facts JSON from `vlserve probe --json` (default: probe this host)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (schema %s)" % sizing.PLAN_SCHEMA)
    add_policy_flags(plan)
    plan.set_defaults(handler=cmd_plan)
