"""`vlserve deployment save|restore|list`: the deployments a host keeps (ops/deployments.py), as the
deploy role and playbooks/rollback.yml use them. Each prints one JSON object (what changed)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from vlserve.cli.common import BadInput


def _store(args: argparse.Namespace):
    from vlserve.ops.deployments import Deployments  # noqa: PLC0415

    return Deployments(args.dir, root=args.root)


def cmd_save(args: argparse.Namespace) -> int:
    from vlserve.ops.deployments import deployment_files  # noqa: PLC0415
    from vlserve.ops.units import PLAN_FILE  # noqa: PLC0415

    plan_file = pathlib.Path(args.root or "/") / PLAN_FILE.lstrip("/")
    try:
        plan = json.loads(plan_file.read_text())
    except (OSError, ValueError) as error:
        raise BadInput("cannot read the plan %s: %s" % (plan_file, error)) from None
    result = _store(args).save(args.fingerprint, args.release, deployment_files(plan), keep=args.keep)
    print(json.dumps(result))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from vlserve.ops.deployments import DeploymentError, managed_files  # noqa: PLC0415
    from vlserve.ops.units import PLAN_FILE  # noqa: PLC0415

    store = _store(args)
    try:
        if args.leaving:
            result = store.go_back(args.leaving, managed_files(), args.current_link, args.fingerprint_file)
        else:
            result = store.restore(store.last_good(), managed_files(), args.current_link, args.fingerprint_file)
    except DeploymentError as error:
        raise BadInput(str(error)) from None
    plan = json.loads((pathlib.Path(args.root or "/") / PLAN_FILE.lstrip("/")).read_text())
    workers = [{"index": worker["index"], "port": worker["port"]} for worker in plan["worker_list"]]
    print(json.dumps(dict(result, workers=workers)))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    kept = [dict(store.meta(deployment), deployment=deployment) for deployment in store.history()]
    json.dump({"deployments": kept, "releases": store.releases()}, sys.stdout, indent=2)
    print()
    return 0


def add_commands(commands) -> None:
    from vlserve.ops.deployments import CURRENT_LINK, DEPLOYMENTS_DIR, FINGERPRINT_FILE, KEPT  # noqa: PLC0415

    deployment = commands.add_parser(
        "deployment", help="the deployments this host keeps: save one, put one back, list them"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dir", default=DEPLOYMENTS_DIR, help="where they are kept (default: %(default)s)")
        parser.add_argument("--root", default="", help=argparse.SUPPRESS)  # tests: a tree standing for /

    save = deployment.add_parser("save", help="keep what this host runs (after its health gate passed)")
    save.add_argument("--fingerprint", required=True, help="the deployment's fingerprint, as the rollout compares it")
    save.add_argument("--release", required=True, help="the release it runs (a directory under releases/)")
    save.add_argument("--keep", type=int, default=KEPT, help="how many to keep (default: %(default)s)")
    common(save)
    save.set_defaults(handler=cmd_save)

    restore = deployment.add_parser("restore", help="put back the last deployment kept, or leave a release")
    restore.add_argument(
        "--leaving",
        metavar="RELEASE",
        help="leave this release: a host that runs it gets its newest deployment of an earlier one back (a host "
        "that does not run it is left alone)",
    )
    restore.add_argument(
        "--current-link", default=CURRENT_LINK, help="the install's current link (default: %(default)s)"
    )
    restore.add_argument(
        "--fingerprint-file", default=FINGERPRINT_FILE, help="where the fingerprint goes (default: %(default)s)"
    )
    common(restore)
    restore.set_defaults(handler=cmd_restore)

    listing = deployment.add_parser("list", help="the deployments kept, oldest first, and the releases they need")
    common(listing)
    listing.set_defaults(handler=cmd_list)
