"""The benchmarks: `bench`, `bench-compare`, `bench-peer`, `autotune`, `bench-decode`, `quant-check`,
`bench-bandwidth`, `bench-footprint`."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from vlserve import sizing
from vlserve.bench.pagehistory import HISTORIES
from vlserve.cli.common import (
    BadInput,
    add_policy_flags,
    add_workload_flags,
    policy_from_args,
    write_json,
)
from vlserve.sizing.contract import AUTO, FLOAT_DTYPES, QUANTIZE_LEVELS, QUANTIZED_LEVELS


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
            payload=lambda index: workload.payload(index, args.model_name),
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
    write_json(args.output, report)
    print(
        json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2)
        if args.json
        else render_report(report)
    )
    return 1 if report["failed"] and not report["completed"] else 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from vlserve.bench.compare import CompareOptions, compare, render_compare  # noqa: PLC0415

    try:
        policy = policy_from_args(args)
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
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render_compare(result))
    return 0


def cmd_bench_peer(args: argparse.Namespace) -> int:
    from vlserve.bench.peer import PeerOptions, bench_peer, render  # noqa: PLC0415
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.model.loader import check_model_directory  # noqa: PLC0415

    model = pathlib.Path(args.model)
    try:
        check_model_directory(model)
    except ModelDirectoryError as error:
        raise BadInput(str(error)) from None
    if any(clients < 1 for clients in args.concurrency) or 1 not in args.concurrency:
        raise BadInput("--concurrency needs 1 (the single-stream figures) and counts of at least 1")
    if args.side_by_side < 0:
        raise BadInput("--side-by-side takes a count of request pairs, 0 or more")
    threads = args.threads or sizing.default_threads(sizing.probe(use_libraries=False))
    result = bench_peer(
        PeerOptions(
            model=model,
            cache=pathlib.Path(args.cache),
            pairs=tuple(args.pairs),
            rounds=args.rounds,
            concurrency=tuple(sorted(set(args.concurrency))),
            requests=args.requests,
            side_by_side=args.side_by_side,
            threads=threads,
            image_size=args.image_size,
            max_tokens=args.max_tokens,
            amx=not args.no_amx,
            progress=not args.json,
        )
    )
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def cmd_autotune(args: argparse.Namespace) -> int:
    from vlserve.bench.autotune import AutotuneOptions, autotune, host_override, render_autotune  # noqa: PLC0415

    try:
        policy = policy_from_args(args)
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
    write_json(args.output, result)
    if args.write_override:
        pathlib.Path(args.write_override).write_text(host_override(result))
        print("wrote the best configuration to %s" % args.write_override, file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else render_autotune(result))
    return 0


def cmd_bench_bandwidth(args: argparse.Namespace) -> int:
    from vlserve.bench.bandwidth import decode_bytes_per_token, measure_read_bandwidth  # noqa: PLC0415
    from vlserve.kernels import native  # noqa: PLC0415 - torch, only for this command
    from vlserve.settings import ModelSettings  # noqa: PLC0415

    threads = args.threads or sizing.default_threads(sizing.probe(use_libraries=False))
    kernels = native.load(ModelSettings().native_kernel_root())  # their read where they run
    result = measure_read_bandwidth(threads, size_bytes=args.buffer_bytes, kernels=kernels)
    if args.model:
        per_token = decode_bytes_per_token(pathlib.Path(args.model), args.dtype, args.quantize)
        result.update(decode_bytes_per_token=per_token, decode_bound_tokens_per_s=result["bytes_per_s"] / per_token)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        "memory read bandwidth: %.1f GB/s (%s's read; %d threads, %.1f GiB buffer, %d%% of it in 2 MiB pages,"
        " last-level cache %.0f MiB)"
        % (
            result["bytes_per_s"] / 1e9,
            result["reader"],
            threads,
            result["buffer_bytes"] / 2**30,
            100 * result["buffer_huge_page_bytes"] // result["buffer_bytes"],
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
    from vlserve.bench.decode import DecodeOptions, bench_decode, render  # noqa: PLC0415
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.model.loader import check_model_directory  # noqa: PLC0415

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
            batches=tuple(args.batches),
            cache_history=tuple(args.cache_history),
        )
    )
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def cmd_bench_footprint(args: argparse.Namespace) -> int:
    from vlserve.bench.footprint import FootprintOptions, bench_footprint, misses, render  # noqa: PLC0415
    from vlserve.bench.workload import parse_size  # noqa: PLC0415
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.model.loader import check_model_directory  # noqa: PLC0415

    try:
        check_model_directory(pathlib.Path(args.model))
        size = parse_size(args.image_size)
    except (ModelDirectoryError, ValueError) as error:
        raise BadInput(str(error)) from None
    say = (lambda message: print(message, file=sys.stderr)) if args.json else print
    result = bench_footprint(
        FootprintOptions(
            model=pathlib.Path(args.model),
            levels=tuple(args.levels),
            image_size=size,
            max_tokens=args.max_tokens,
            say=say,
        )
    )
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if any(misses(level) for level in result["levels"]) else 0


def cmd_quant_check(args: argparse.Namespace) -> int:
    from vlserve.bench.quantcheck import CheckOptions, quant_check, render  # noqa: PLC0415
    from vlserve.errors import ModelDirectoryError  # noqa: PLC0415
    from vlserve.model.loader import check_model_directory  # noqa: PLC0415

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
    write_json(args.output, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_commands(commands) -> None:
    """Add the benchmark commands to the parser's commands."""
    _add_bench(commands)
    _add_compare(commands)
    _add_peer(commands)
    _add_tune(commands)
    _add_decode(commands)
    _add_check(commands)
    _add_bandwidth(commands)
    _add_footprint(commands)


def _add_bench(commands) -> None:
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
    bench.add_argument("--model-name", help="model name to send (default: none, the server's)")
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
    add_workload_flags(bench, max_tokens=32)
    bench.set_defaults(handler=cmd_bench)


def _add_compare(commands) -> None:
    compare = commands.add_parser(
        "bench-compare",
        help="naive vs tuned on this machine, in one run: the table of ratios docs/benchmarks.md quotes",
    )
    compare.add_argument(
        "--model",
        dest="model_dir",
        required=True,
        help="checkpoint directory (make-test-model --size real); --footprint is the sizing footprint",
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
    add_workload_flags(compare, max_tokens=32)
    add_policy_flags(compare)
    compare.set_defaults(handler=cmd_bench_compare)


def _add_peer(commands) -> None:
    from vlserve.bench.peer import PAIRS  # noqa: PLC0415 - no torch behind it

    peer = commands.add_parser(
        "bench-peer",
        help="vlserve against llama.cpp's server at equal rounding, in interleaved rounds: the ratio table",
        description="Builds llama-server from the pinned llama-cpp-python sdist, converts the checkpoint to "
        "GGUF with llama.cpp's converter (both cached under --cache), then times both servers with the same "
        "requests: TTFT, TPOT, throughput at each concurrency, peak and settled memory, start to ready.",
    )
    peer.add_argument("--model", required=True, help="checkpoint directory (make-test-model --size real)")
    peer.add_argument(
        "--cache", default="/var/tmp/vlserve-bench/peer", help="builds and GGUF files (default: %(default)s)"
    )
    peer.add_argument(
        "--pairs",
        nargs="+",
        choices=tuple(PAIRS),
        default=list(PAIRS),
        help="vlserve levels to compare, each with llama.cpp's type of the same rounding: "
        + ", ".join("%s with %s" % item for item in PAIRS.items()),
    )
    peer.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    peer.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="client counts (default: 1 2 4 8)"
    )
    peer.add_argument("--requests", type=int, default=4, help="single-client requests per round (default: 4)")
    peer.add_argument(
        "--side-by-side",
        type=int,
        default=4,
        metavar="PAIRS",
        help="request pairs per round and pair of servers with both up, each pair one photo to each in "
        "turn: time per token and to first token as ratios of the pairs (default: 4; 0 skips them)",
    )
    peer.add_argument("--threads", type=int, help="threads for both servers (default: the service's default)")
    peer.add_argument(
        "--no-amx",
        action="store_true",
        help="build llama.cpp without its AMX kernels (by default they are built, their tile-config load "
        "fixed for GCC 12: vlserve.bench.llamacpp.TILE_CONFIG_PATCH)",
    )
    add_workload_flags(peer, max_tokens=32)
    peer.set_defaults(handler=cmd_bench_peer)


def _add_tune(commands) -> None:
    tune = commands.add_parser(
        "autotune", help="measure the configurations this host allows and rank the plan's choice among them"
    )
    tune.add_argument(
        "--model", dest="model_dir", required=True, help="checkpoint directory; --footprint is the sizing footprint"
    )
    tune.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    tune.add_argument("--requests", type=int, default=8, help="requests per configuration (default: 8)")
    tune.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes to try (default: 1 and the plan's)")
    tune.add_argument(
        "--dtypes",
        nargs="+",
        choices=FLOAT_DTYPES,
        help="dtypes to try (default: those the CPU runs natively)",
    )
    tune.add_argument(
        "--levels",
        nargs="+",
        choices=(AUTO, *QUANTIZE_LEVELS),
        help="quantize levels to try (default: the policy's --quantize only: rounding is the operator's call)",
    )
    tune.add_argument(
        "--write-override", metavar="FILE", help="write the best configuration as Ansible host_vars to FILE"
    )
    add_workload_flags(tune, max_tokens=16)
    add_policy_flags(tune)
    tune.set_defaults(handler=cmd_autotune)


def _add_decode(commands) -> None:
    decode = commands.add_parser(
        "bench-decode", help="single-stream decode speed at each quantize level, the levels taking turns"
    )
    decode.add_argument("--model", required=True, help="checkpoint directory")
    decode.add_argument("--levels", nargs="+", choices=QUANTIZE_LEVELS, default=list(QUANTIZE_LEVELS))
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
        "--batches",
        nargs="*",
        type=int,
        default=[4],
        help="sequence counts decoded together, each timed after the single stream (default: 4)",
    )
    decode.add_argument(
        "--kernels",
        choices=("auto", "stock", "both"),
        default="auto",
        help="int8 products through vlserve's own decode kernel where it runs (auto), torch's only (stock), "
        "or each quantized level both ways, in turn (both)",
    )
    decode.add_argument(
        "--cache-history",
        nargs="+",
        choices=HISTORIES,
        default=[],
        help="before each turn, put its level's weight files into this page-cache history, the histories "
        "taking turns round by round: fresh (dropped, read in order) or aged (dropped, other memory "
        "written and freed, read back in scattered 4 KiB pages); default: the cache as it is",
    )
    decode.add_argument("--json", action="store_true", help="print JSON")
    decode.add_argument("--output", metavar="FILE", help="also write the result as JSON to FILE")
    decode.set_defaults(handler=cmd_bench_decode)


def _add_check(commands) -> None:
    check = commands.add_parser(
        "quant-check",
        help="what each quantize level's rounding costs on a checkpoint: next-token agreement and KL divergence",
    )
    check.add_argument("--model", required=True, help="checkpoint directory")
    check.add_argument("--levels", nargs="+", choices=QUANTIZED_LEVELS, default=list(QUANTIZED_LEVELS), help="levels")
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


def _add_bandwidth(commands) -> None:
    bandwidth = commands.add_parser(
        "bench-bandwidth", help="memory read bandwidth, and the decode rate it allows a model's weights"
    )
    bandwidth.add_argument("--model", help="checkpoint directory: also print its decode bound")
    bandwidth.add_argument("--dtype", choices=FLOAT_DTYPES, default="bfloat16", help="weights dtype")
    bandwidth.add_argument("--quantize", choices=QUANTIZE_LEVELS, default="none", help="quantize level of the weights")
    bandwidth.add_argument("--threads", type=int, help="reading threads (default: the service's default)")
    bandwidth.add_argument("--buffer-bytes", type=int, help="buffer size (default: max(1 GiB, 4 x last-level cache))")
    bandwidth.add_argument("--json", action="store_true", help="print JSON")
    bandwidth.set_defaults(handler=cmd_bench_bandwidth)


def _add_footprint(commands) -> None:
    footprint = commands.add_parser(
        "bench-footprint",
        help="a worker's real memory at each quantize level (load peak, settled, serving a full batch) "
        "against its plan's figures; exit 1 where a figure does not hold the measurement",
    )
    footprint.add_argument("--model", required=True, help="checkpoint directory (the real-size one)")
    footprint.add_argument("--levels", nargs="+", choices=QUANTIZE_LEVELS, default=list(QUANTIZE_LEVELS))
    footprint.add_argument("--image-size", default="1280x720", help="WxH of each request's photo (default: 1280x720)")
    footprint.add_argument("--max-tokens", type=int, default=64, help="answer length (default: 64)")
    footprint.add_argument("--json", action="store_true", help="print JSON")
    footprint.add_argument("--output", metavar="FILE", help="also write the result as JSON to FILE")
    footprint.set_defaults(handler=cmd_bench_footprint)
