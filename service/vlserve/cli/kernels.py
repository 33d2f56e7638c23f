"""`vlserve kernels`: build and check vlserve's kernels before any worker starts (the deploy role's step)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

from vlserve.cli.common import BadInput


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build (when missing), load and check the kernels; record the outcome; prune other builds.
    Exit 0 whatever the outcome (torch's kernels are an outcome, named in `status`); 2 on bad input."""
    from vlserve.kernels import native  # noqa: PLC0415 - torch, only for this command
    from vlserve.settings import ModelSettings  # noqa: PLC0415

    root = pathlib.Path(args.cache_dir) if args.cache_dir else ModelSettings().native_kernel_root()
    if root is None:
        raise BadInput("native_kernels is off: there is nothing to build")
    if not root.is_absolute():
        raise BadInput("--cache-dir must be an absolute directory, not %r" % args.cache_dir)
    library = native.library_path(root)
    existed = library.is_file()
    kernels = native.load(root)
    own = kernels.ops is not None
    record = {
        "own": own,
        # whether this CPU, under this torch, runs a tier at all: where it does not, torch's kernels
        # are the plan, not a fault
        "expected": native.cpu_reason() is None,
        "status": kernels.status,
        "tier": kernels.tier,
        "library": str(library) if own else None,
        "built": own and not existed,
        "pruned": [str(path) for path in native.prune(root, library)] if own else [],
    }
    _write(root / native.BUILD_RECORD, record)
    print(json.dumps(record, indent=1) if args.json else kernels.status)
    return 0


def _write(path: pathlib.Path, record: dict) -> None:
    """Written aside and renamed: a worker reading it meanwhile sees the old record or the new."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".build-", delete=False) as handle:
        json.dump(record, handle, indent=1)
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, path)


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
