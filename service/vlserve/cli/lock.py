"""`vlserve model lock` and `vlserve model verify`: pin a checkpoint by its files' sha256, and check a copy."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from vlserve.cli.common import BadInput

LOCK_VARIABLE = "vlserve_deploy_model_lock"  # the deploy role's variable that holds it


def _read_lock(source: str) -> dict:
    import yaml  # noqa: PLC0415

    from vlserve.ops.modellock import LockError, check_lock  # noqa: PLC0415

    try:
        text = sys.stdin.read() if source == "-" else pathlib.Path(source).read_text()
        lock = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as error:
        raise BadInput("cannot read the lock %s: %s" % (source, str(error).splitlines()[0])) from None
    if isinstance(lock, dict) and LOCK_VARIABLE in lock:  # the file `model lock` writes, as it is
        lock = lock[LOCK_VARIABLE]
    try:
        return check_lock(lock)
    except LockError as error:
        raise BadInput("the lock %s: %s" % (source, error)) from None


def cmd_lock(args: argparse.Namespace) -> int:
    import yaml  # noqa: PLC0415

    from vlserve.ops.modellock import LockError, make_lock  # noqa: PLC0415

    try:
        lock = make_lock(pathlib.Path(args.checkpoint), repo=args.repo)
    except LockError as error:
        raise BadInput(str(error)) from None
    origin = (
        "hub commit %s" % lock["revision"]
        if lock["revision"]
        else "no hub commit found (a local checkpoint): copy it from the controller (model_source controller)"
    )
    text = "# vlserve model lock of %s: %d files, %s.\n# Keep it in the inventory (group_vars), as is.\n%s" % (
        args.checkpoint,
        len(lock["files"]),
        origin,
        yaml.safe_dump({LOCK_VARIABLE: lock}, sort_keys=False),
    )
    if args.output:
        pathlib.Path(args.output).write_text(text)
        print("wrote %s (%s)" % (args.output, origin), file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """0 the checkpoint matches; 2 it does not, or the lock is bad (one line). --json: the verdict, exit 0."""
    from vlserve.ops.modellock import verify  # noqa: PLC0415

    lock = _read_lock(args.lock)
    verdict = verify(pathlib.Path(args.checkpoint), lock, quick=args.quick)
    if args.json:
        print(json.dumps(verdict.as_dict()))
        return 0
    if not verdict.ok:
        raise BadInput(verdict.first_fault(args.checkpoint.rstrip("/")))
    print(verdict.first_fault(args.checkpoint.rstrip("/")))
    return 0


def add_commands(commands) -> None:
    """Add `model` (lock, verify) to the parser's commands."""
    model = commands.add_parser(
        "model", help="pin a checkpoint in a lock (every file's sha256), or check one against it"
    )
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    lock = actions.add_parser("lock", help="write the lock of a checkpoint directory (YAML for the inventory)")
    lock.add_argument("checkpoint", help="the checkpoint directory")
    lock.add_argument("--repo", help="the hub repository it came from, for the record (e.g. Qwen/Qwen3-VL-2B-Instruct)")
    lock.add_argument("--output", metavar="FILE", help="write the lock here (default: print it)")
    lock.set_defaults(handler=cmd_lock)
    check = actions.add_parser("verify", help="check a checkpoint directory against a lock")
    check.add_argument("checkpoint", help="the checkpoint directory")
    check.add_argument("--lock", required=True, metavar="FILE", help="the lock (YAML or JSON; - reads stdin)")
    check.add_argument("--json", action="store_true", help="print the verdict as JSON (exit 0 whatever it says)")
    check.add_argument(
        "--quick", action="store_true", help="sizes only: what a copy would write, not a verdict on the contents"
    )
    check.set_defaults(handler=cmd_verify)
