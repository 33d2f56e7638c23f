"""The toolkit's command line: one module per command group, each adding its own commands.

host (probe, plan) | serve | render (render-units, render-fleet) | model (make-test-model) | bench
(bench, bench-compare, autotune, bench-decode, quant-check, bench-bandwidth). `--model` is a
checkpoint directory in every command; the sizing policy's footprint is `--footprint`.
"""

from __future__ import annotations

import argparse
import sys

from vlserve import __version__
from vlserve.cli import bench, host, model, render, serve
from vlserve.cli.common import BadInput

GROUPS = (host, serve, render, model, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlserve", description="Size, tune and serve Qwen3-VL on CPU-only hosts.")
    parser.add_argument("--version", action="version", version="vlserve " + __version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
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
