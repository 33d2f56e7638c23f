"""What the command groups share: bad input, facts files, the sizing policy's flags, JSON output."""

from __future__ import annotations

import argparse
import json
import pathlib
import typing
from dataclasses import fields

from vlserve import sizing


def policy_flag_type(annotation):
    """The argparse type for a Policy field, from its annotation."""
    hint = typing.get_type_hints(sizing.Policy)[annotation]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if typing.get_origin(base) in (list, list):
        return sizing.parse_cpu_list
    return base


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Policy field, so the CLI and the planner cannot disagree on what can be set."""
    group = parser.add_argument_group("sizing policy")
    for item in fields(sizing.Policy):
        # `--model` is a checkpoint directory in every command; the policy's model is its footprint.
        flag = "--footprint" if item.name == "model" else "--" + item.name.replace("_", "-")
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
            type=policy_flag_type(item.name),
            choices=item.metadata.get("choices"),
            default=None,
            metavar=item.name.upper(),
            help=item.metadata["help"],
        )


def policy_from_args(args: argparse.Namespace) -> sizing.Policy:
    return sizing.Policy.from_mapping({item.name: getattr(args, item.name) for item in fields(sizing.Policy)})


class BadInput(Exception):
    """Input the command cannot use (a facts file, a policy value): one line, exit status 2."""


def load_facts(path: str | None) -> dict:
    """This host's facts, or those of a file, checked against the facts schema."""
    if not path:
        return sizing.probe()
    try:
        with open(path, encoding="utf-8") as handle:
            facts = json.load(handle)
    except OSError as error:
        raise BadInput("cannot read %s: %s" % (path, error.strerror or error)) from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise BadInput("%s is not valid JSON (truncated?): %s" % (path, error)) from None
    try:
        sizing.check_facts(facts)
    except sizing.FactsError as error:
        raise BadInput("%s: %s" % (path, error)) from None
    return facts


def write_json(path: str | None, data: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")


def image_size(text: str) -> tuple[int, int] | None:
    from vlserve.bench.workload import parse_size  # noqa: PLC0415

    if text.lower() == "none":
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_workload_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--image-size",
        type=image_size,
        default=(1280, 720),
        metavar="WxH",
        help="size of the generated photo in each request, or 'none' for text only (default: 1280x720)",
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output", metavar="FILE", help="also write the whole result as JSON to FILE")
