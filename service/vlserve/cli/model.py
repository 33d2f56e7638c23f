"""`vlserve make-test-model`: a Qwen3-VL checkpoint with random weights, offline."""

from __future__ import annotations

import argparse

from vlserve.cli.common import (
    BadInput,
)
from vlserve.model.testmodel import OUTLIER_SCALE


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from vlserve.model.testmodel import make_test_model  # noqa: PLC0415

    try:
        path = make_test_model(
            args.directory,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            outliers=args.outlier_channels,
            outlier_scale=args.outlier_scale,
        )
    except ValueError as error:  # refused before anything is written
        raise BadInput(str(error)) from None
    shape = " and %d outlier channels" % args.outlier_channels if args.outlier_channels else ""
    print("wrote a %s Qwen3-VL test checkpoint with random weights%s to %s" % (args.size, shape, path))
    return 0


def add_commands(commands) -> None:
    """Add make-test-model to the parser's commands."""
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
    test_model.add_argument(
        "--outlier-channels",
        type=int,
        default=0,
        metavar="N",
        help="give N channels of the residual streams activations --outlier-scale times larger, in every "
        "layer, as trained models have them (norm weights scaled; quantization is judged on such a "
        "checkpoint too; default: 0)",
    )
    test_model.add_argument(
        "--outlier-scale",
        type=float,
        default=OUTLIER_SCALE,
        metavar="X",
        help="how much larger the outlier channels are (default: %g)" % OUTLIER_SCALE,
    )
    test_model.set_defaults(handler=cmd_make_test_model)
