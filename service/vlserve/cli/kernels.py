"""`vlserve kernels`: build and check vlserve's kernels before any worker starts (the deploy role's step)."""

from __future__ import annotations

import argparse
import json
import pathlib

from vlserve.cli.common import BadInput
from vlserve.kernels import record


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build (when missing), load and check the kernels; record the outcome; prune other builds. A
    record of the same inputs whose library is still there is the outcome again, without torch.
    Exit 0 whatever the outcome (torch's kernels are an outcome, named in `status`); 2 on bad input."""
    from vlserve.settings import ModelSettings  # noqa: PLC0415

    root = pathlib.Path(args.cache_dir) if args.cache_dir else ModelSettings().native_kernel_root()
    if root is None:
        raise BadInput("native_kernels is off: there is nothing to build")
    if not root.is_absolute():
        raise BadInput("--cache-dir must be an absolute directory, not %r" % args.cache_dir)
    inputs = record.inputs()
    found = record.still_holds(root, inputs)
    if found is not None:
        found = {**found, "built": False, "pruned": [], "checked": False}
        record.write(root, found)
        print(json.dumps(found, indent=1) if args.json else found["status"] + " (checked before, same inputs)")
        return 0
    from vlserve.kernels import native  # noqa: PLC0415 - torch, only when something changed

    library = native.library_path(root)
    existed = library.is_file()
    kernels = native.load(root)
    own = kernels.ops is not None
    outcome = {
        "own": own,
        # whether this CPU, under this torch, runs a tier at all: where it does not, torch's kernels
        # are the plan, not a fault
        "expected": native.cpu_reason() is None,
        "status": kernels.status,
        "tier": kernels.tier,
        "library": str(library) if own else None,
        "built": own and not existed,
        "pruned": [str(path) for path in native.prune(root, library)] if own else [],
        "checked": True,  # loaded and checked by this run (False: a record of the same inputs held)
        "inputs": inputs,
    }
    record.write(root, outcome)
    print(json.dumps(outcome, indent=1) if args.json else kernels.status)
    return 0


def add_commands(commands) -> None:
    """Add kernels to the parser's commands."""
    kernels = commands.add_parser(
        "kernels",
        help="build and check vlserve's kernels for this host before workers start (the deploy role's step)",
    )
    kernels.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the builds go (default: the native_kernels setting's directory, as `serve` finds it)",
    )
    kernels.add_argument("--json", action="store_true", help="print the record as JSON (as build.json holds it)")
    kernels.set_defaults(handler=cmd_kernels)
