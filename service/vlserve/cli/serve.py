"""`vlserve serve`: one inference worker, its flags taken from the settings models."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import types
import typing

from vlserve.sizing.contract import ENV_PREFIX


def _settings_flag(parser: argparse._ArgumentGroup, name: str, info) -> None:
    """One flag for a settings field: its type, choices and description come from the model."""
    base = info.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
        base = next(a for a in typing.get_args(base) if a is not type(None))
    env = ENV_PREFIX + name.upper()
    default = info.default if info.default_factory is None else info.default_factory()
    shown = "" if default is None or (isinstance(default, list) and not default) else " (default: %s)" % default
    text = "%s%s [env %s]" % (info.description, shown, env)
    flag = "--" + name.replace("_", "-")
    if base is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif typing.get_origin(base) is typing.Literal:
        parser.add_argument(flag, dest=name, choices=typing.get_args(base), default=None, help=text)
    elif typing.get_origin(base) is list:
        parser.add_argument(
            flag,
            dest=name,
            type=lambda value: [v for v in value.split(",") if v],
            default=None,
            metavar="A,B",
            help=text,
        )
    else:
        kind = {int: int, float: float}.get(base, str)
        parser.add_argument(flag, dest=name, type=kind, default=None, metavar=name.upper(), help=text)


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    from vlserve.settings import SETTINGS_MODELS  # noqa: PLC0415 - pydantic only for the service commands

    for model in SETTINGS_MODELS:
        group = parser.add_argument_group(model.__name__.removesuffix("Settings").lower() + " settings")
        for name, info in model.model_fields.items():
            _settings_flag(group, name, info)


@contextlib.contextmanager
def _collecting_nothing() -> typing.Iterator[None]:
    """No cyclic collections while the worker imports torch and its libraries: their objects (630,000
    when it imported transformers too) live as long as the process, and collections walking them
    again and again took 0.4-1.5 s of a 5-8 s start (docs/benchmark-history.md). Frozen after, later
    collections skip them."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def cmd_serve(args: argparse.Namespace) -> int:
    import pydantic  # noqa: PLC0415

    from vlserve.settings import SETTINGS_MODELS, Settings  # noqa: PLC0415

    try:
        parts = [
            model(**{name: getattr(args, name) for name in model.model_fields if getattr(args, name) is not None})
            for model in SETTINGS_MODELS
        ]
    except pydantic.ValidationError as error:
        print("vlserve serve: invalid settings:\n%s" % error, file=sys.stderr)
        return 2
    settings = Settings(*parts)
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with _collecting_nothing():
        import uvicorn  # noqa: PLC0415

        from vlserve.api.app import create_app  # noqa: PLC0415
        from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
        from vlserve.model.loader import check_model_directory  # noqa: PLC0415
    try:
        check_model_directory(settings.model.model)
    except ModelDirectoryError as error:
        logging.getLogger("vlserve").error("cannot start: %s", error)
        from vlserve.api import notify  # noqa: PLC0415

        notify.status("cannot start: %s" % error)
        return 1
    holder: dict = {}
    app = create_app(settings, on_fatal=lambda message: setattr(holder["server"], "should_exit", True))
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=30,
    )
    holder["server"] = server = uvicorn.Server(config)
    server.run()
    return 1 if app.state.fatal else 0


def add_commands(commands) -> None:
    """Add serve to the parser's commands."""
    serve = commands.add_parser(
        "serve",
        help="run one inference worker (OpenAI-compatible HTTP API)",
        description="Every setting is also an environment variable (VLSERVE_<NAME>); flags win.",
    )
    _add_settings_flags(serve)
    serve.set_defaults(handler=cmd_serve)
