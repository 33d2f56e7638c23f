"""The toolkit's command line: one module per command group, each adding its own commands.

host (probe, plan) | serve | kernels | render (render-units, render-fleet) | keys (keys new, keys
check) | lock (model lock, model verify) | deployment (save, restore, list) | model
(make-test-model) | bench (bench, bench-compare, autotune, bench-decode, quant-check,
bench-bandwidth). `--model` is a checkpoint directory in every
command; the sizing policy's footprint is `--footprint`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from vlserve import __version__
from vlserve.cli import bench, deployment, host, kernels, keys, lock, model, render, serve
from vlserve.cli.common import BadInput

# The planner and the renderers run on a bare controller; the rest needs the service's stack
# (`pip install vlserve[serve]`, what the hosts get), and is listed only where it is installed.
BARE_GROUPS = (host, render, keys, lock, deployment)
SERVICE_GROUPS = (serve, kernels, model, bench)
SERVICE_STACK = ("torch", "transformers", "fastapi", "uvicorn", "httpx")


def service_stack_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in SERVICE_STACK)


def build_parser() -> argparse.ArgumentParser:
    with_service = service_stack_installed()
    parser = argparse.ArgumentParser(
        prog="vlserve",
        description="Size, tune and serve Qwen3-VL on CPU-only hosts.",
        epilog=None
        if with_service
        else "serve, the benchmarks and make-test-model need the service's packages: pip install 'vlserve[serve]'",
    )
    parser.add_argument("--version", action="version", version="vlserve " + __version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in BARE_GROUPS + (SERVICE_GROUPS if with_service else ()):
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 the host cannot run one worker, 2 bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BadInput as error:
        print("vlserve %s: %s" % (args.command, error), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
