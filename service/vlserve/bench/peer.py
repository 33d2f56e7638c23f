"""`vlserve bench-peer`: vlserve against llama.cpp's server, the tool users would pick instead, on the
same checkpoint, the same machine, the same client, in interleaved rounds.

llama.cpp is built and the checkpoint converted by vlserve.bench.llamacpp, cached under `--cache`.

The pairs compare equal rounding: none vs bf16, int8 vs Q8_0 (the same blocks of 32 with a scale),
int4 vs Q4_K_M and Q4_0. Both servers get the same thread count, the same image-token cap and the
same `vlserve bench` requests; llama-server gets `-np N` slots for N concurrent clients (one start
per N), vlserve runs its plan for the level and batches on its own.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlserve.bench import pagehistory
from vlserve.bench.llamacpp import LlamaServer, build_llama, convert
from vlserve.bench.loadgen import LoadSpec, MemoryWatch, run_load, single_requests
from vlserve.bench.servers import (
    mapped_files,
    start_plan_workers,
    warm_files,
    warm_page_cache,
)
from vlserve.bench.workload import Workload

SCHEMA = "vlserve.bench-peer/1"
# vlserve level -> the llama.cpp type of the same rounding.
PAIRS = {"none": "bf16", "int8": "Q8_0", "int4": "Q4_K_M", "int4/Q4_0": "Q4_0"}
COMMON = {"request_timeout_s": "7200", "max_queue": "1024"}
# Photos of the load at N clients: seeds LOAD_SEEDS + N * LOAD_SEED_STRIDE on (the later turns' are
# 5000 on). Every load sends photos no earlier load sent: vlserve serves all the loads of a round from
# one process, whose result, vision and prefix caches would answer a photo and question it has seen
# (llama-server restarts for each slot count, its caches empty).
LOAD_SEEDS, LOAD_SEED_STRIDE = 10_000, 1_000


@dataclass
class PeerOptions:
    model: Path
    cache: Path = Path("/var/tmp/vlserve-bench/peer")
    pairs: tuple[str, ...] = tuple(PAIRS)
    rounds: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests: int = 4  # single-client requests per round; N clients send 2N
    side_by_side: int = 4  # request pairs per round with both servers up, taking turns (0: none)
    threads: int = 2
    image_size: tuple[int, int] | None = (1280, 720)  # None: text-only questions
    max_tokens: int = 32
    amx: bool = True  # False: build ggml without its AMX kernels (TILE_CONFIG_PATCH fixes one crash of theirs)
    progress: bool = True
    log: list[str] = field(default_factory=list)


def _say(options: PeerOptions, message: str) -> None:
    options.log.append(message)
    if options.progress:
        print(message, file=sys.stderr, flush=True)


# -- the rounds ------------------------------------------------------------------------------------


def image_tokens(model: Path, size: tuple[int, int] | None) -> int:
    """The image tokens a vlserve worker with default settings gives the workload's photo: the cap
    llama-server gets too (both fit the picture in patches of 32 pixels under it)."""
    if size is None:
        return 0
    from vlserve.model.processor import load_processor  # noqa: PLC0415 - torch only here
    from vlserve.runtime.images import load_image  # noqa: PLC0415
    from vlserve.settings import ModelSettings  # noqa: PLC0415

    fields = ModelSettings.model_fields
    min_pixels, max_pixels = fields["min_pixels"].default, fields["max_pixels"].default
    processor = load_processor(model)
    processor.image_processor.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    photo = Workload(image_size=size).image(0)
    image = load_image(photo, max_source_pixels=2**31, max_pixels=max_pixels, param="image").image
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
    merge = processor.image_processor.merge_size
    return int(grid.prod()) // (merge * merge)


def _load(options: PeerOptions, urls: list[str], clients: int, pids: list[int]) -> dict:
    seed = LOAD_SEEDS + clients * LOAD_SEED_STRIDE
    workload = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=seed)
    requests = options.requests if clients == 1 else 2 * clients
    assert requests < LOAD_SEED_STRIDE, "the loads' photos would overlap"
    report = run_load(
        LoadSpec(
            urls=urls,
            payload=lambda index: workload.payload(index, None),
            requests=requests,
            concurrency=clients,
            warmup=1,
            server_pids=pids,
            progress=False,
        )
    )
    if report["failed"]:
        raise RuntimeError("%d of the requests to %s failed: %s" % (report["failed"], urls, report["errors"]))
    results = report["results"]
    return {
        "ttft_s": report["ttft_s"]["p50"],
        "tpot_s": report["tpot_s"]["p50"],
        "output_tokens_per_s": report["output_throughput"],
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in results if r["prompt_tokens"]),
        "peak_rss_bytes": report["server_peak_rss_bytes"],
    }


# What the client sends back as the first answer in a follow-up turn. Random weights answer in filler
# tokens that do not come back the same through text, so an ordinary sentence of about a 16-token
# answer's length stands in: both servers reuse the first prompt and compute this and the new question
# (with a trained model's own answer they would reuse it too, and compute less).
STAND_IN_ANSWER = "The photo shows a bright room with a table, two chairs and a window on the left."


def _later_turns(options: PeerOptions, url: str) -> dict:
    """For each of `options.requests` new photos, one client: a first question, a second question
    about the same photo, and a follow-up turn (the first question, an answer, a new question). The
    server may shorten the later ones by reusing the first prompt's keys and values (vlserve's prefix
    cache, llama-server's prompt cache) or its image's encoding."""
    first, second, follow_up = [], [], []
    for index in range(options.requests):
        photos = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=5000 + index)
        opening = photos.payload(0, None, question=0)
        turns = json.loads(json.dumps(opening))
        turns["messages"] += [
            {"role": "assistant", "content": STAND_IN_ANSWER},
            {"role": "user", "content": "Why do you think so?"},
        ]
        one, two, three = single_requests([url] * 3, [opening, photos.payload(0, None, question=1), turns])
        first.append(one.ttft_s)
        second.append(two.ttft_s)
        follow_up.append(three.ttft_s)
    return {
        "first_ttft_s": statistics.median(first),
        "second_ttft_s": statistics.median(second),
        "follow_up_ttft_s": statistics.median(follow_up),
    }


# Photos of the side-by-side pairs (a warm-up for each side first): seeds of their own, as above.
SIDE_BY_SIDE_SEEDS = 7000


def side_by_side(options: PeerOptions, urls: dict[str, str]) -> list[dict]:
    """With both servers up (`urls`: side -> URL), `options.side_by_side` pairs of single requests: each
    pair one new photo and question, sent to one side and then the other (who goes first alternates),
    after a warm-up request to each. This project's VMs change their memory's speed within seconds, so
    time per token from one side's round and the other's can meet different memory; a pair's two
    requests run seconds apart. Returns each pair's TTFT and TPOT by side."""
    sides = list(urls)
    warm = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=SIDE_BY_SIDE_SEEDS - 1)
    single_requests([urls[side] for side in sides], [warm.payload(0, None)] * len(sides))
    pairs = []
    for index in range(options.side_by_side):
        photos = Workload(image_size=options.image_size, max_tokens=options.max_tokens, seed=SIDE_BY_SIDE_SEEDS + index)
        body = photos.payload(0, None)
        order = sides if index % 2 == 0 else sides[::-1]
        results = single_requests([urls[side] for side in order], [body] * len(order))
        pairs.append({side: {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for side, r in zip(order, results, strict=True)})
    return pairs


def run_side_by_side(
    options: PeerOptions, build: dict, files: dict[str, Path], pair: str, *, tokens: int, served_files: set[Path]
) -> list[dict]:
    """`side_by_side` for one pair: the level's plan workers and llama-server (one slot) started
    together, each side's files warm."""
    level, kind = pair.split("/", maxsplit=1)[0], PAIRS[pair]
    warm_page_cache(options.model)
    warm_files(sorted(served_files))
    warm_files((files[kind], files["mmproj"]))
    workers = start_plan_workers(options.model, _plan(level), extra=COMMON | {"threads": str(options.threads)})
    llama = None
    try:
        llama = LlamaServer(
            build["server"], files[kind], files["mmproj"], threads=options.threads, slots=1, image_tokens=tokens
        )
        llama.wait_ready()
        return side_by_side(options, {"vlserve": workers[0].url, "llama": llama.url})
    finally:
        if llama is not None:
            llama.stop()
        for worker in workers:
            worker.stop()


def _rss(pids: list[int]) -> int:
    return MemoryWatch(pids).sample()


def _plan(level: str) -> dict:
    from vlserve import sizing  # noqa: PLC0415

    return sizing.plan(sizing.probe(), sizing.Policy(quantize=level))


def run_vlserve(options: PeerOptions, level: str, served_files: set[Path]) -> dict:
    """`served_files`: what the level's workers mapped at their first start (checkpoint, weight cache,
    libraries), read into the page cache first as llama-server's GGUF files are."""
    warm_page_cache(options.model)
    warm_files(sorted(served_files))
    servers = start_plan_workers(options.model, _plan(level), extra=COMMON | {"threads": str(options.threads)})
    try:
        pids = [server.process.pid for server in servers]
        figures = {
            "workers": len(servers),
            "ready_s": max(server.ready_after_s for server in servers),
            "settled_s": max(server.settled_after_s for server in servers),
            "settled_rss_bytes": _rss(pids),
            "loads": {},
        }
        for clients in options.concurrency:
            figures["loads"][clients] = _load(options, [server.url for server in servers], clients, pids)
        figures["turns"] = _later_turns(options, servers[0].url)
        figures["peak_rss_bytes"] = max(sum(s.peak_rss_bytes for s in servers), _rss(pids))
    finally:
        for server in servers:
            server.stop()
    return figures


def run_llama(options: PeerOptions, build: dict, files: dict[str, Path], kind: str, tokens: int) -> dict:
    figures: dict = {"loads": {}}
    peaks = []
    for clients in options.concurrency:
        warm_files((files[kind], files["mmproj"]))
        server = LlamaServer(
            build["server"], files[kind], files["mmproj"], threads=options.threads, slots=clients, image_tokens=tokens
        )
        try:
            server.wait_ready()
            pids = [server.process.pid]
            if clients == options.concurrency[0]:
                figures.update(ready_s=server.ready_after_s, settled_s=server.ready_after_s)
                figures["settled_rss_bytes"] = _rss(pids)
            figures["loads"][clients] = _load(options, [server.url], clients, pids)
            if clients == options.concurrency[0]:
                figures["turns"] = _later_turns(options, server.url)
            peaks.append(max(server.memory.peak_bytes, _rss(pids)))
        finally:
            server.stop()
    figures["peak_rss_bytes"] = max(peaks)
    return figures


def bench_peer(options: PeerOptions) -> dict:
    def say(message: str) -> None:
        _say(options, message)

    options.cache.mkdir(parents=True, exist_ok=True)
    build = build_llama(options.cache, amx=options.amx, say=say)
    files = convert(options.model, options.cache, build, {PAIRS[pair] for pair in options.pairs}, say=say)
    tokens = image_tokens(options.model, options.image_size)
    # As the GGUF files are made before any timing, so is each level's weight cache (and vlserve's
    # kernels): a first start that rounds the weights is a deployment step, not a start.
    first_starts, served_files = {}, {}
    for level in dict.fromkeys(pair.split("/")[0] for pair in options.pairs):
        say("first start of vlserve %s (weight cache, kernels), untimed" % level)
        started = time.perf_counter()
        served_files[level] = set()
        for server in start_plan_workers(options.model, _plan(level), extra=COMMON):
            served_files[level] |= mapped_files(server.process.pid)
            server.stop()
        first_starts[level] = round(time.perf_counter() - started, 1)
    # The weight files of every side: each side starts with its own warm and the others dropped from
    # the cache. Together they outgrow what a host of this size caches beside a running server, and the
    # reclaim would leave the next side's files partly cached, not as a host that serves one model does.
    checkpoint = {path for path in options.model.iterdir() if path.suffix == ".safetensors"}
    own = {("vlserve", level): checkpoint | {path for path in paths if path.suffix == ".safetensors"}
           for level, paths in served_files.items()}  # fmt: skip
    own.update({("llama", PAIRS[pair]): {files[PAIRS[pair]], files["mmproj"]} for pair in options.pairs})
    weights = set().union(*own.values())
    rounds: list[dict] = []
    for index in range(options.rounds):
        measured: dict = {}
        for pair in options.pairs:
            level = pair.split("/")[0]
            sides = [("vlserve", lambda level=level: run_vlserve(options, level, served_files[level])),
                     ("llama", lambda pair=pair: run_llama(options, build, files, PAIRS[pair], tokens))]  # fmt: skip
            if index % 2:  # who goes first alternates, so neither always meets a cooler machine
                sides.reverse()
            measured[pair] = {}
            for side, run in sides:
                name = level if side == "vlserve" else PAIRS[pair]
                say("round %d/%d: %s %s" % (index + 1, options.rounds, side, name))
                for path in sorted(weights - own[side, name]):
                    pagehistory.drop(path)
                measured[pair][side] = run()
            if options.side_by_side:
                say("round %d/%d: %s side by side with %s" % (index + 1, options.rounds, level, PAIRS[pair]))
                for path in sorted(weights - own["vlserve", level] - own["llama", PAIRS[pair]]):
                    pagehistory.drop(path)
                measured[pair]["side_by_side"] = run_side_by_side(
                    options, build, files, pair, tokens=tokens, served_files=served_files[level]
                )
        rounds.append(measured)
    return {
        "schema": SCHEMA,
        "llama_cpp": {k: v for k, v in build.items() if k not in ("server", "quantize", "source")},
        "model": str(options.model),
        "threads": options.threads,
        "image_size": list(options.image_size),
        "image_tokens": tokens,
        "vlserve_first_start_s": first_starts,
        "max_tokens": options.max_tokens,
        "concurrency": list(options.concurrency),
        "pairs": {pair: PAIRS[pair] for pair in options.pairs},
        "rounds": rounds,
        "summary": summarize(rounds, options),
    }


# -- the table -------------------------------------------------------------------------------------


def figures(concurrency: list[int] | tuple[int, ...]) -> list[tuple]:
    """The table's rows: name, how to read it from a side's round, unit scale, better when lower.
    Memory per client count too: llama-server allocates each start's key/value cache for all its
    slots up front, so its overall peak is its widest start's."""
    many = [n for n in concurrency if n > 1]
    return [
        ("TTFT (ms)", lambda side: side["loads"]["1"]["ttft_s"], 1000, True),
        ("TPOT (ms)", lambda side: side["loads"]["1"]["tpot_s"], 1000, True),
        ("2nd question TTFT (ms)", lambda side: side["turns"]["second_ttft_s"], 1000, True),
        (
            "2nd / 1st question TTFT",
            lambda side: side["turns"]["second_ttft_s"] / side["turns"]["first_ttft_s"],
            1,
            True,
        ),
        (
            "follow-up / 1st TTFT",
            lambda side: side["turns"]["follow_up_ttft_s"] / side["turns"]["first_ttft_s"],
            1,
            True,
        ),
        *(("tok/s at %d" % n, lambda side, n=n: side["loads"][str(n)]["output_tokens_per_s"], 1, False) for n in many),
        ("peak memory (GB)", lambda side: side["peak_rss_bytes"], 1e-9, True),
        *(
            ("memory at %d (GB)" % n, lambda side, n=n: side["loads"][str(n)]["peak_rss_bytes"], 1e-9, True)
            for n in concurrency
        ),
        ("settled memory (GB)", lambda side: side["settled_rss_bytes"], 1e-9, True),
        ("ready (s)", lambda side: side["ready_s"], 1, True),
        ("settled (s)", lambda side: side["settled_s"], 1, True),
    ]


def summarize(rounds: list[dict], options: PeerOptions) -> dict:
    """Per pair and figure: each side's median and range over the rounds, and the ratio of the medians."""
    rounds = json.loads(json.dumps(rounds))  # concurrency keys as strings, as in the written JSON
    summary: dict = {}
    for pair in options.pairs:
        summary[pair] = {}
        for name, pick, scale, _lower in figures(options.concurrency):
            values = {side: [pick(r[pair][side]) * scale for r in rounds] for side in ("vlserve", "llama")}
            medians = {side: statistics.median(v) for side, v in values.items()}
            summary[pair][name] = {
                **{side: {"median": medians[side], "min": min(v), "max": max(v)} for side, v in values.items()},
                "ratio": medians["vlserve"] / medians["llama"] if medians["llama"] else None,
            }
        summary[pair].update(summarize_side_by_side([p for r in rounds for p in r[pair].get("side_by_side", [])]))
    return summary


SIDE_BY_SIDE_FIGURES = {"TTFT side by side (ms)": "ttft_s", "TPOT side by side (ms)": "tpot_s"}


def summarize_side_by_side(pairs: list[dict]) -> dict:
    """Over every round's side-by-side pairs: each side's median and range, and the ratio as the
    median of the pairs' own ratios (each pair met one moment of the machine), with their range."""
    if not pairs:
        return {}
    summary = {}
    for name, key in SIDE_BY_SIDE_FIGURES.items():
        values = {side: [p[side][key] * 1000 for p in pairs] for side in ("vlserve", "llama")}
        ratios = [p["vlserve"][key] / p["llama"][key] for p in pairs]
        summary[name] = {
            **{side: {"median": statistics.median(v), "min": min(v), "max": max(v)} for side, v in values.items()},
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "pairs": len(pairs),
        }
    return summary


def render(result: dict) -> str:
    llama = result["llama_cpp"]
    lines = [
        "vlserve against llama.cpp %s (llama-cpp-python %s%s), %d threads, %d image tokens, %d-token answers, "
        "%d rounds; medians (range), ratio vlserve / llama.cpp"
        % (
            llama["commit"][:9],
            llama["llama_cpp_python"],
            "" if llama["amx"] else ", AMX off",
            result["threads"],
            result["image_tokens"],
            result["max_tokens"],
            len(result["rounds"]),
        )
    ]
    lower = {name: low for name, _pick, _scale, low in figures(result["concurrency"])}
    lower.update(dict.fromkeys(SIDE_BY_SIDE_FIGURES, True))
    for pair, rows in result["summary"].items():
        lines.append("")
        lines.append("%-22s %-22s %-22s %s" % (pair + " vs " + result["pairs"][pair], "vlserve", "llama.cpp", "ratio"))
        for name, figure in rows.items():

            def cell(side: dict) -> str:
                return "%s (%s-%s)" % (_number(side["median"]), _number(side["min"]), _number(side["max"]))

            ratio = figure["ratio"]
            lines.append(
                "%-22s %-22s %-22s %s"
                % (
                    name,
                    cell(figure["vlserve"]),
                    cell(figure["llama"]),
                    "-"
                    if ratio is None
                    else "%.2fx%s%s" % (ratio, _pairs_range(figure), "" if lower[name] else " (higher is better)"),
                )
            )
    return "\n".join(lines)


def _pairs_range(figure: dict) -> str:
    """A side-by-side figure's ratio range over its request pairs."""
    if "ratio_range" not in figure:
        return ""
    return " (%.2f-%.2fx over %d pairs)" % (*figure["ratio_range"], figure["pairs"])


def _number(value: float) -> str:
    return "%.0f" % value if abs(value) >= 100 else "%.1f" % value if abs(value) >= 10 else "%.2f" % value
