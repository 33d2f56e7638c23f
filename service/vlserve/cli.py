"""The toolkit's command line: `vlserve probe`, `vlserve plan` (and the service's commands)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import pathlib
import sys
import types
import typing
from dataclasses import fields

from vlserve import __version__, sizing
from vlserve.testmodel import OUTLIER_SCALE


def _policy_flag_type(annotation):
    """The argparse type for a Policy field, from its annotation."""
    hint = typing.get_type_hints(sizing.Policy)[annotation]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    if typing.get_origin(base) in (list, list):
        return sizing.parse_cpu_list
    return base


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Policy field, so the CLI and the planner cannot disagree on what can be set."""
    group = parser.add_argument_group("sizing policy")
    for item in fields(sizing.Policy):
        flag = "--" + item.name.replace("_", "-")
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
            type=_policy_flag_type(item.name),
            default=None,
            metavar=item.name.upper(),
            help=item.metadata["help"],
        )


def _policy_from_args(args: argparse.Namespace) -> sizing.Policy:
    return sizing.Policy.from_mapping({item.name: getattr(args, item.name) for item in fields(sizing.Policy)})


class BadInput(Exception):
    """Input the command cannot use (a facts file, a policy value): one line, exit status 2."""


def _load_facts(path: str | None) -> dict:
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


def cmd_probe(args: argparse.Namespace) -> int:
    facts = sizing.probe(root=args.root)
    print(sizing.dumps(facts) if args.json else sizing.render_facts(facts))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    facts = _load_facts(args.facts)
    try:
        policy = _policy_from_args(args)
        sizing.check_policy_fits(facts["limits"], policy)
    except ValueError as error:
        print("vlserve plan: invalid policy: %s" % error, file=sys.stderr)
        return 2
    try:
        result = sizing.plan(facts, policy)
    except sizing.PlanError as error:
        if args.json:
            print(json.dumps({"schema": sizing.PLAN_SCHEMA, "error": str(error)}, indent=2))
        print("vlserve plan: cannot plan %s: %s" % (facts.get("hostname", "this host"), error), file=sys.stderr)
        return 1
    if args.json:
        print(sizing.dumps(result))
    else:
        print(sizing.render_facts(facts))
        print()
        print(sizing.render_plan(result))
    return 0


def _settings_flag(parser: argparse._ArgumentGroup, name: str, info) -> None:
    """One flag for a settings field: its type, choices and description come from the model."""
    base = info.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
        base = next(a for a in typing.get_args(base) if a is not type(None))
    env = "VLSERVE_" + name.upper()
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
    """No cyclic collections while the worker imports torch and transformers: their 630,000 objects
    live as long as the process, and collections walking them again and again took 0.4-1.5 s of a
    5-8 s start (docs/benchmarks.md). Frozen after, later collections skip them."""
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

        from vlserve.app import create_app  # noqa: PLC0415
        from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
        from vlserve.loader import check_model_directory  # noqa: PLC0415
    try:
        check_model_directory(settings.model.model)
    except ModelDirectoryError as error:
        logging.getLogger("vlserve").error("cannot start: %s", error)
        from vlserve import notify  # noqa: PLC0415

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


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from vlserve.testmodel import make_test_model  # noqa: PLC0415

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


REPO_TEMPLATES = pathlib.Path(__file__).resolve().parent.parent.parent / "templates"
ROLES = pathlib.Path(__file__).resolve().parent.parent.parent / "roles"
DEPLOY_DEFAULTS = ROLES / "vlserve_deploy" / "defaults" / "main.yml"
FRONT_DEFAULTS = ROLES / "vlserve_front" / "defaults" / "main.yml"
MANAGED = "Managed by vlserve render-units: local changes will be overwritten."


def _role_defaults(path: pathlib.Path, prefix: str) -> dict:
    """A role's defaults without their prefix: the options the roles and these commands share."""
    import yaml  # noqa: PLC0415

    return {k[len(prefix) :]: v for k, v in yaml.safe_load(path.read_text()).items()}


def _write_tree(out: str, files: dict[str, str]) -> None:
    for path, text in sorted(files.items()):
        target = pathlib.Path(out) / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)


def cmd_render_units(args: argparse.Namespace) -> int:
    """The deploy role's files, rendered from the same templates and context, for hosts without Ansible."""
    from vlserve.units import PLAN_FILE, render_all, units_context  # noqa: PLC0415

    facts = _load_facts(args.facts)
    try:
        policy = _policy_from_args(args)
    except ValueError as error:
        raise BadInput("invalid policy: %s" % error) from None
    try:
        result = sizing.plan(facts, policy)
    except sizing.PlanError as error:
        print("vlserve render-units: %s" % error, file=sys.stderr)
        return 1
    options = _role_defaults(DEPLOY_DEFAULTS, "vlserve_deploy_")
    for name in ("model_dir", "front_port", "api_key", "user", "install_dir"):
        if getattr(args, "deploy_" + name) is not None:
            options[name] = getattr(args, "deploy_" + name)
    files = render_all(pathlib.Path(args.templates), units_context(result, options), MANAGED)
    _write_tree(args.out, files | {PLAN_FILE: sizing.dumps(result) + "\n"})
    print(
        "%d worker(s); copy the tree to / on the host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve.target" % len(result["worker_list"]),
        file=sys.stderr,
    )
    return 0


def _backend(text: str) -> dict:
    """NAME=ADDRESS:PORT[:WEIGHT], one service host behind a fleet front."""
    name, _, where = text.partition("=")
    parts = where.split(":")
    if not name or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError("expected NAME=ADDRESS:PORT[:WEIGHT], not %r" % text)
    return {"name": name, "address": parts[0], "port": int(parts[1]), "weight": int(parts[2]) if len(parts) > 2 else 1}


def cmd_render_fleet(args: argparse.Namespace) -> int:
    """The vlserve_front role's files for a fleet front, from the same templates and context."""
    from vlserve.units import fleet_context, render_fleet  # noqa: PLC0415

    options = _role_defaults(FRONT_DEFAULTS, "vlserve_front_")
    for name in ("port", "bind", "api_key", "check_interval_s"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    context = fleet_context(args.backend, options)
    _write_tree(args.out, render_fleet(pathlib.Path(args.templates), context, MANAGED))
    print(
        "%d host(s) behind port %d; copy the tree to / on the front host, then: systemctl daemon-reload && "
        "systemctl enable --now vlserve-fleet.service" % (len(args.backend), context["front"]["port"]),
        file=sys.stderr,
    )
    return 0


def _image_size(text: str) -> tuple[int, int] | None:
    from vlserve.bench.workload import parse_size  # noqa: PLC0415

    if text.lower() == "none":
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _write_json(path: str | None, data: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")


def cmd_bench(args: argparse.Namespace) -> int:
    from vlserve.bench.loadgen import LoadSpec, render_report, run_load  # noqa: PLC0415
    from vlserve.bench.workload import Workload  # noqa: PLC0415

    if args.requests is None and args.duration is None:
        args.requests = 16
    workload = Workload(
        image_size=args.image_size,
        max_tokens=args.max_tokens,
        ignore_eos=not args.no_ignore_eos,
        distinct_images=not args.same_image,
        seed=args.seed,
    )
    report = run_load(
        LoadSpec(
            urls=args.url,
            payload=lambda index: workload.payload(index, args.model),
            requests=args.requests,
            duration_s=args.duration,
            concurrency=args.concurrency,
            rate=args.rate,
            warmup=args.warmup,
            api_key=args.api_key,
            server_pids=args.server_pid,
            progress=not args.json,
            seed=args.seed,
        )
    )
    _write_json(args.output, report)
    print(
        json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2)
        if args.json
        else render_report(report)
    )
    return 1 if report["failed"] and not report["completed"] else 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from vlserve.bench.compare import CompareOptions, compare, render_compare  # noqa: PLC0415

    try:
        policy = _policy_from_args(args)
    except ValueError as error:
        print("vlserve bench-compare: invalid policy: %s" % error, file=sys.stderr)
        return 2
    result = compare(
        CompareOptions(
            model=pathlib.Path(args.model_dir),
            image_size=args.image_size,
            max_tokens=args.max_tokens,
            latency_requests=args.latency_requests,
            clients=args.clients,
            throughput_requests=args.throughput_requests,
            cache_pairs=args.cache_pairs,
            startup_runs=args.startup_runs,
            policy=policy,
            level_columns=args.level_columns,
        )
    )
    _write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render_compare(result))
    return 0


def cmd_autotune(args: argparse.Namespace) -> int:
    from vlserve.bench.autotune import AutotuneOptions, autotune, host_override, render_autotune  # noqa: PLC0415

    try:
        policy = _policy_from_args(args)
    except ValueError as error:
        print("vlserve autotune: invalid policy: %s" % error, file=sys.stderr)
        return 2
    result = autotune(
        AutotuneOptions(
            model=pathlib.Path(args.model_dir),
            image_size=args.image_size,
            max_tokens=args.max_tokens,
            clients=args.clients,
            requests=args.requests,
            batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else None,
            dtypes=tuple(args.dtypes) if args.dtypes else None,
            levels=tuple(args.levels) if args.levels else None,
            policy=policy,
        )
    )
    _write_json(args.output, result)
    if args.write_override:
        pathlib.Path(args.write_override).write_text(host_override(result))
        print("wrote the best configuration to %s" % args.write_override, file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else render_autotune(result))
    return 0


def cmd_bench_bandwidth(args: argparse.Namespace) -> int:
    from vlserve.bench.bandwidth import decode_bytes_per_token, measure_read_bandwidth  # noqa: PLC0415

    threads = args.threads or sizing.default_threads(sizing.probe(use_libraries=False))
    result = measure_read_bandwidth(threads, size_bytes=args.buffer_bytes)
    if args.model:
        per_token = decode_bytes_per_token(pathlib.Path(args.model), args.dtype, args.quantize)
        result.update(decode_bytes_per_token=per_token, decode_bound_tokens_per_s=result["bytes_per_s"] / per_token)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        "memory read bandwidth: %.1f GB/s (%d threads, %.1f GiB buffer, last-level cache %.0f MiB)"
        % (
            result["bytes_per_s"] / 1e9,
            threads,
            result["buffer_bytes"] / 2**30,
            result["last_level_cache_bytes"] / 2**20,
        )
    )
    if args.model:
        print(
            "a decode step reads %.2f GB of %s weights (quantize=%s): one stream decodes at most %.2f tokens/s"
            % (result["decode_bytes_per_token"] / 1e9, args.dtype, args.quantize, result["decode_bound_tokens_per_s"])
        )
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from vlserve.bench.bandwidth import measure_read_bandwidth  # noqa: PLC0415
    from vlserve.bench.decode import DecodeOptions, bench_decode, render  # noqa: PLC0415
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.loader import check_model_directory  # noqa: PLC0415

    try:
        check_model_directory(pathlib.Path(args.model))
    except ModelDirectoryError as error:
        raise BadInput(str(error)) from None
    threads = args.threads or sizing.default_threads(sizing.probe(use_libraries=False))
    result = bench_decode(
        DecodeOptions(
            model=pathlib.Path(args.model),
            levels=tuple(args.levels),
            tokens=args.tokens,
            rounds=args.rounds,
            threads=threads,
            dtype=args.dtype,
            prompt_tokens=args.prompt_tokens,
            kernels=args.kernels,
        )
    )
    result["read_bandwidth_bytes_per_s"] = measure_read_bandwidth(threads)["bytes_per_s"]
    _write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result, result["read_bandwidth_bytes_per_s"]))
    return 0


def cmd_quant_check(args: argparse.Namespace) -> int:
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.loader import check_model_directory  # noqa: PLC0415
    from vlserve.quantcheck import CheckOptions, quant_check, render  # noqa: PLC0415

    model = pathlib.Path(args.model)
    try:
        check_model_directory(model)
    except ModelDirectoryError as error:
        raise BadInput(str(error)) from None
    for image in args.image or ():
        if not pathlib.Path(image).is_file():
            raise BadInput("image %s does not exist" % image)
    result = quant_check(
        CheckOptions(
            model=model,
            levels=tuple(args.levels),
            prompts=args.prompts,
            answer_tokens=args.answer_tokens,
            images=tuple(pathlib.Path(i) for i in args.image or ()),
            threads=args.threads,
            exact_vision=args.exact_vision,
        )
    )
    _write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def _add_workload_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--image-size",
        type=_image_size,
        default=(1280, 720),
        metavar="WxH",
        help="size of the generated photo in each request, or 'none' for text only (default: 1280x720)",
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output", metavar="FILE", help="also write the whole result as JSON to FILE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlserve", description=__doc__)
    parser.add_argument("--version", action="version", version="vlserve " + __version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    probe = commands.add_parser("probe", help="print the facts the sizing engine sees on this host")
    probe.add_argument("--json", action="store_true", help="print the facts as JSON (schema %s)" % sizing.FACTS_SCHEMA)
    probe.add_argument("--root", default="/", help="read /proc and /sys below this directory (default: /)")
    probe.set_defaults(handler=cmd_probe)

    plan = commands.add_parser("plan", help="print the sizing plan for this host or for captured facts")
    plan.add_argument(
        "--facts", metavar="FILE", help="facts JSON from `vlserve probe --json` (default: probe this host)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (schema %s)" % sizing.PLAN_SCHEMA)
    _add_policy_flags(plan)
    plan.set_defaults(handler=cmd_plan)

    serve = commands.add_parser(
        "serve",
        help="run one inference worker (OpenAI-compatible HTTP API)",
        description="Every setting is also an environment variable (VLSERVE_<NAME>); flags win.",
    )
    _add_settings_flags(serve)
    serve.set_defaults(handler=cmd_serve)

    render = commands.add_parser(
        "render-units", help="write the systemd units and front config for this host's plan (no Ansible needed)"
    )
    render.add_argument("--out", required=True, help="directory to write the file tree into (mirrors /)")
    render.add_argument("--facts", metavar="FILE", help="facts JSON to plan for (default: probe this host)")
    render.add_argument(
        "--templates", default=str(REPO_TEMPLATES), help="the templates directory (default: %(default)s)"
    )
    render.add_argument("--model-dir", dest="deploy_model_dir", help="model directory on the host")
    render.add_argument("--front-port", dest="deploy_front_port", type=int, help="port of the front")
    render.add_argument("--api-key", dest="deploy_api_key", help="API key the front requires")
    render.add_argument("--user", dest="deploy_user", help="user the workers run as")
    render.add_argument("--install-dir", dest="deploy_install_dir", help="where the service's venv is")
    _add_policy_flags(render)
    render.set_defaults(handler=cmd_render_units)

    fleet = commands.add_parser(
        "render-fleet", help="write a fleet front's HAProxy config and unit (no Ansible needed)"
    )
    fleet.add_argument("--out", required=True, help="directory to write the file tree into (mirrors /)")
    fleet.add_argument(
        "--backend",
        type=_backend,
        action="append",
        required=True,
        metavar="NAME=ADDRESS:PORT[:WEIGHT]",
        help="a service host's front; repeat per host (weight: its worker count)",
    )
    fleet.add_argument("--port", type=int, help="port of the fleet front")
    fleet.add_argument("--bind", help="address the fleet front listens on")
    fleet.add_argument("--api-key", dest="api_key", help="API key the fleet front requires")
    fleet.add_argument("--check-interval-s", dest="check_interval_s", type=int, help="seconds between health checks")
    fleet.add_argument(
        "--templates", default=str(REPO_TEMPLATES), help="the templates directory (default: %(default)s)"
    )
    fleet.set_defaults(handler=cmd_render_fleet)

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

    bench = commands.add_parser(
        "bench",
        help="load-test any OpenAI-compatible endpoint: TTFT, TPOT, latency percentiles, throughput",
        description="Streams chat completions with generated photos and fixed questions at a concurrency "
        "or a Poisson rate; reports what `vllm bench serve` reports.",
    )
    bench.add_argument(
        "--url",
        action="append",
        required=True,
        help="endpoint (http://host:port, .../v1 or .../v1/chat/completions); repeat to spread over workers",
    )
    bench.add_argument("--model", help="model name to send (default: none, the server's)")
    bench.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    bench.add_argument("--concurrency", type=int, default=1, help="clients in a closed loop (default: 1)")
    bench.add_argument("--rate", type=float, help="requests per second, Poisson arrivals (instead of a closed loop)")
    bench.add_argument("--requests", type=int, help="requests to measure (default: 16 unless --duration)")
    bench.add_argument("--duration", type=float, help="seconds to keep sending")
    bench.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted (default: 1)")
    bench.add_argument("--same-image", action="store_true", help="one image for every request (vision-cache hits)")
    bench.add_argument("--no-ignore-eos", action="store_true", help="let answers stop at end-of-sequence")
    bench.add_argument("--seed", type=int, default=0, help="seed of the generated images (default: 0)")
    bench.add_argument(
        "--server-pid",
        type=int,
        action="append",
        help="server process to watch for peak memory (default: the local listener)",
    )
    _add_workload_flags(bench, max_tokens=32)
    bench.set_defaults(handler=cmd_bench)

    compare = commands.add_parser(
        "bench-compare",
        help="naive vs tuned on this machine, in one run: the table of ratios docs/benchmarks.md quotes",
    )
    compare.add_argument(
        "--model-dir",
        required=True,
        help="checkpoint directory (make-test-model --size real); --model is the footprint",
    )
    compare.add_argument("--latency-requests", type=int, default=3, help="single-client requests (default: 3)")
    compare.add_argument("--clients", type=int, default=4, help="concurrent clients for throughput (default: 4)")
    compare.add_argument("--throughput-requests", type=int, default=8, help="requests at that concurrency (default: 8)")
    compare.add_argument("--cache-pairs", type=int, default=2, help="pairs for the cache figures (default: 2)")
    compare.add_argument("--startup-runs", type=int, default=2, help="starts per configuration (default: 2)")
    compare.add_argument(
        "--no-level-columns",
        dest="level_columns",
        action="store_false",
        help="skip the extra columns for the plan at the other quantize levels (int8, int4)",
    )
    _add_workload_flags(compare, max_tokens=32)
    _add_policy_flags(compare)
    compare.set_defaults(handler=cmd_bench_compare)

    tune = commands.add_parser(
        "autotune", help="measure the configurations this host allows and rank the plan's choice among them"
    )
    tune.add_argument("--model-dir", required=True, help="checkpoint directory; --model is the footprint")
    tune.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    tune.add_argument("--requests", type=int, default=8, help="requests per configuration (default: 8)")
    tune.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes to try (default: 1 and the plan's)")
    tune.add_argument(
        "--dtypes",
        nargs="+",
        choices=("bfloat16", "float32"),
        help="dtypes to try (default: those the CPU runs natively)",
    )
    tune.add_argument(
        "--levels",
        nargs="+",
        choices=("auto", "none", "int8", "int4"),
        help="quantize levels to try (default: the policy's --quantize only: rounding is the operator's call)",
    )
    tune.add_argument(
        "--write-override", metavar="FILE", help="write the best configuration as Ansible host_vars to FILE"
    )
    _add_workload_flags(tune, max_tokens=16)
    _add_policy_flags(tune)
    tune.set_defaults(handler=cmd_autotune)

    decode = commands.add_parser(
        "bench-decode", help="single-stream decode speed at each quantize level, the levels taking turns"
    )
    decode.add_argument("--model", required=True, help="checkpoint directory")
    decode.add_argument("--levels", nargs="+", choices=("none", "int8", "int4"), default=["none", "int8", "int4"])
    decode.add_argument("--tokens", type=int, default=32, help="timed decode steps per round (default: 32)")
    decode.add_argument("--rounds", type=int, default=5, help="rounds, the levels taking turns (default: 5)")
    decode.add_argument("--threads", type=int, help="torch threads (default: the service's default)")
    decode.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the rest's dtype (default: as planned)",
    )
    decode.add_argument("--prompt-tokens", type=int, default=256, help="prompt timed once per round (default: 256)")
    decode.add_argument(
        "--kernels",
        choices=("auto", "stock", "both"),
        default="auto",
        help="int8 products through vlserve's own decode kernel where it runs (auto), torch's only (stock), "
        "or each quantized level both ways, in turn (both)",
    )
    decode.add_argument("--json", action="store_true", help="print JSON")
    decode.add_argument("--output", metavar="FILE", help="also write the result as JSON to FILE")
    decode.set_defaults(handler=cmd_bench_decode)

    check = commands.add_parser(
        "quant-check",
        help="what each quantize level's rounding costs on a checkpoint: next-token agreement and KL divergence",
    )
    check.add_argument("--model", required=True, help="checkpoint directory")
    check.add_argument("--levels", nargs="+", choices=("int8", "int4"), default=["int8", "int4"], help="levels")
    check.add_argument("--prompts", type=int, default=4, help="generated photos with questions (default: 4)")
    check.add_argument("--image", action="append", help="use this image instead of generated ones (repeatable)")
    check.add_argument("--answer-tokens", type=int, default=32, help="exact greedy answer length (default: 32)")
    check.add_argument("--threads", type=int, help="torch threads (default: the service's default)")
    check.add_argument(
        "--exact-vision",
        action="store_true",
        help="keep the vision tower exact at every level: the language model's rounding alone "
        "(default: each level as a worker on this host serves it)",
    )
    check.add_argument("--json", action="store_true", help="print JSON")
    check.add_argument("--output", metavar="FILE", help="also write the result as JSON to FILE")
    check.set_defaults(handler=cmd_quant_check)

    bandwidth = commands.add_parser(
        "bench-bandwidth", help="memory read bandwidth, and the decode rate it allows a model's weights"
    )
    bandwidth.add_argument("--model", help="checkpoint directory: also print its decode bound")
    bandwidth.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights dtype")
    bandwidth.add_argument(
        "--quantize", choices=("none", "int8", "int4"), default="none", help="quantize level of the weights"
    )
    bandwidth.add_argument("--threads", type=int, help="reading threads (default: the service's default)")
    bandwidth.add_argument("--buffer-bytes", type=int, help="buffer size (default: max(1 GiB, 4 x last-level cache))")
    bandwidth.add_argument("--json", action="store_true", help="print JSON")
    bandwidth.set_defaults(handler=cmd_bench_bandwidth)
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
