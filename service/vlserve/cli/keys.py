"""`vlserve keys new` and `vlserve keys check`: the API's client keys, as the inventory keeps them."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from vlserve.cli.common import BadInput

CLIENTS_VARIABLE = "vlserve_clients"  # the inventory variable both roles read the key set from


def read_clients(source: str) -> list:
    """A key file: the list itself, or a mapping holding it under vlserve_clients (a group_vars file as is)."""
    import yaml  # noqa: PLC0415

    from vlserve.ops.clients import ClientsError, parse_clients  # noqa: PLC0415

    try:
        entries = yaml.safe_load(pathlib.Path(source).read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(
            "cannot read the key file %s: %s" % (source, getattr(error, "strerror", None) or error)
        ) from None
    except yaml.YAMLError as error:
        # The parser's message may quote the line it stopped at: a key. Name the place only.
        mark = getattr(error, "problem_mark", None)
        where = " at line %d" % (mark.line + 1) if mark is not None else ""
        raise BadInput("the key file %s is not YAML%s" % (source, where)) from None
    if isinstance(entries, dict) and CLIENTS_VARIABLE in entries:
        entries = entries[CLIENTS_VARIABLE]
    try:
        parse_clients(entries, source)
    except ClientsError as error:
        raise BadInput(str(error)) from None
    return entries


def cmd_new(args: argparse.Namespace) -> int:
    """A new client entry with a fresh key, as YAML to add to the key set (printed once, or written 0600)."""
    import yaml  # noqa: PLC0415

    from vlserve.ops.clients import ClientsError, new_key, parse_clients  # noqa: PLC0415

    limits = {name: getattr(args, name) for name in ("concurrent", "requests_per_minute", "tokens_per_minute")}
    limits = {name: value for name, value in limits.items() if value is not None}
    if args.models:
        limits["models"] = args.models.split(",")
    entry = {"name": args.name, "key": new_key()}
    if limits:
        entry["limits"] = limits
    try:
        parse_clients([entry], "the new client")
    except ClientsError as error:
        raise BadInput(str(error)) from None
    text = yaml.safe_dump([entry], sort_keys=False)
    if args.output:
        target = pathlib.Path(args.output)
        existing = target.read_text() if target.exists() else ""
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "a") as handle:
            handle.write(("" if not existing or existing.endswith("\n") else "\n") + text)
        print("added client %s to %s (keep it under Ansible Vault)" % (args.name, target), file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Check a key file; print each client's name, limits and key digest prefix, never a key."""
    from vlserve.ops.clients import parse_clients  # noqa: PLC0415

    clients = parse_clients(read_clients(args.file), args.file)
    for client in clients:
        limits = ", ".join(
            "%s %d" % (name, value)
            for name, value in (
                ("concurrent", client.concurrent),
                ("requests/min", client.requests_per_minute),
                ("tokens/min", client.tokens_per_minute),
            )
            if value
        )
        print(
            "%-24s sha256 %s…  %s; models %s"
            % (client.name, client.digest[:12], limits or "no limits", ",".join(client.models))
        )
    print("%d client(s), every key well formed" % len(clients), file=sys.stderr)
    return 0


def add_commands(commands) -> None:
    """Add `keys new` and `keys check` to the parser's commands."""
    keys = commands.add_parser("keys", help="make and check the API's client keys (the fronts hold only digests)")
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="a new client with a fresh random key, as a YAML entry of the key set")
    new.add_argument("name", help="the client's name (a-z, 0-9, '_', '.', '-'): its usage metrics' label")
    new.add_argument("--concurrent", type=int, help="requests in flight at once")
    new.add_argument("--requests-per-minute", dest="requests_per_minute", type=int, help="requests per minute")
    new.add_argument(
        "--tokens-per-minute",
        dest="tokens_per_minute",
        type=int,
        help="completion tokens per minute (each request reserves its max_tokens)",
    )
    new.add_argument("--models", help="comma-separated served model names the client may use (default: any)")
    new.add_argument("--output", help="append the entry to this key file (created 0600) instead of printing it")
    new.set_defaults(handler=cmd_new)
    check = actions.add_parser("check", help="check a key file and list its clients (digests, never keys)")
    check.add_argument("file", help="YAML: a list of clients, or a mapping with vlserve_clients")
    check.set_defaults(handler=cmd_check)
