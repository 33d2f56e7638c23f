"""Single-stream decode speed at each quantize level, measured side by side: `vlserve bench-decode`.

The levels take turns, round after round, so the machine's drift falls on all of them alike; each
turn is a fresh process that loads the level by the service's loader and finishes its after-ready
work (as a settled worker runs), prefills a fixed prompt once and times `tokens` greedy steps one by
one through the model's KV cache, for one sequence and for each of `batches` sequences decoded
together. Beside each level's tokens/s: its bytes read per step (`decode_weight_bytes`, plus the
keys and values the step's attention reads), the fraction of its own bound it reaches (against the
memory's read speed measured between its steps: each step against a read just before and one just
after it, as this project's VMs change their memory's speed within seconds; median and range over the
rounds), and the process's resident memory once settled. Before the first round, one
untimed load per level makes its weight cache where it is missing, so no timed turn rounds weights
(and holds the checkpoint's pages and the rounding's memory that a worker's usual start does not).

`cache_history` (`--cache-history fresh aged`): before each turn, the weight files its level maps are
put into that round's page-cache history (vlserve.bench.pagehistory, the histories taking turns
round by round), and the report gives each history's steps and the spread over all rounds: whether a
worker's decode speed depends on what the page cache did before it started.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlserve.bench import pagehistory
from vlserve.bench.bandwidth import MemoryReader
from vlserve.bench.servers import mapped_files
from vlserve.model.loader import load_model
from vlserve.model.network import text_positions
from vlserve.runtime.kvcache import new_cache
from vlserve.runtime.sampling import SamplingParams, next_tokens
from vlserve.settings import LimitSettings, ModelSettings
from vlserve.sizing.contract import QUANTIZE_LEVELS


@dataclass(frozen=True)
class DecodeOptions:
    model: Path
    levels: tuple[str, ...] = QUANTIZE_LEVELS
    tokens: int = 32
    rounds: int = 5
    threads: int | None = None
    dtype: str = "auto"  # what is not quantized (and the exact level): as the plan, or forced
    prompt_tokens: int = 256
    kernels: str = "auto"  # auto: vlserve's own kernel where it runs; stock: torch's only; both: each in turn
    batches: tuple[int, ...] = (4,)  # sequence counts decoded together, timed after the single stream
    cache_history: tuple[str, ...] = ()  # each round's page-cache history of the weight files, in turn; () as found

    def turns(self) -> list[tuple[str, str, bool]]:
        """(label, level, own kernel allowed) for each turn of a round."""
        found = []
        for level in self.levels:
            if self.kernels in ("auto", "both") or level == "none":
                found.append((level, level, True))
            if self.kernels in ("stock", "both") and level != "none":
                found.append((level if self.kernels == "stock" else level + " (stock kernels)", level, False))
        return found


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every stored weight of the language model and the output head
    (the input embedding is a lookup of one row, the vision tower does not run)."""
    seen, total = set(), 0
    for module in [*model.model.language_model.modules(), model.lm_head]:
        stored = getattr(module, "stored", None)
        if stored is not None:
            if id(stored) not in seen:
                seen.add(id(stored))
                total += stored.nbytes
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if not (module is model.model.language_model.embed_tokens and name == "weight"):
                total += parameter.numel() * parameter.element_size()
    return total


def kv_bytes_read(config: Any, sequences: int, prompt_tokens: int, tokens: int) -> int:
    """Keys and values a decode step's attention reads, averaged over `tokens` steps after the prompt:
    every cached position of every sequence, each layer's key and value heads."""
    text = config.text_config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2  # bfloat16 cache
    return sequences * (prompt_tokens + tokens // 2) * per_token


def _timings(
    model: Any, tokens: int, prompt_tokens: int, sequences: int = 1, reader: MemoryReader | None = None
) -> tuple[float, list[float], list[dict[str, float]]]:
    """(prefill seconds of a `prompt_tokens` text prompt, decode step seconds, read passes) for `sequences`
    such prompts decoded together, as the engine runs them: its growing KV cache, logits of the last
    position only, its greedy choice of the next tokens. With `reader`, untimed: a pass of its readers
    before the first step and after each one (their speeds by reader), so each step has the memory's
    speed of its own moment on both sides."""
    cache = new_cache(model.config.text_config.num_hidden_layers)
    ids = torch.arange(100, 100 + prompt_tokens)[None].repeat(sequences, 1)
    passes = []
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(ids, None, text_positions(sequences, 0, prompt_tokens), cache, logits_to_keep=1)
        prefill = time.perf_counter() - started
        greedy = [SamplingParams(max_tokens=tokens)] * sequences
        token = next_tokens(out.logits[:, -1, :], greedy)[:, None]
        times = []
        if reader is not None:
            passes.append(reader.speeds())
        for step in range(tokens):
            started = time.perf_counter()
            positions = text_positions(sequences, prompt_tokens + step, 1)
            out = model(token, None, positions, out.cache, logits_to_keep=1)
            token = next_tokens(out.logits[:, -1, :], greedy)[:, None]
            times.append(time.perf_counter() - started)
            if reader is not None:
                passes.append(reader.speeds())
    return prefill, times, passes


def step_shares(read_bytes: float, steps: list[float], passes: list[dict[str, float]]) -> list[float]:
    """Each step's fraction of its bound (`of_bound`) against the memory's speed around it: the mean of
    the faster reader's speeds in the passes just before and just after the step."""
    fastest = [max(speeds.values()) for speeds in passes]
    return [of_bound(read_bytes, step, (fastest[i] + fastest[i + 1]) / 2) for i, step in enumerate(steps)]


def _resident_bytes() -> dict[str, int | None]:
    """This process's resident memory (Linux): `rss_bytes` all of it, mapped weight files' pages too
    (the exact level multiplies its weights where they lie in the checkpoint's map), `rss_anon_bytes`
    its anonymous part (copies and conversions); None where /proc does not say."""
    fields = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes"}
    found: dict[str, int | None] = dict.fromkeys(fields.values())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name = line.split(maxsplit=1)[0] if line.strip() else ""
            if name in fields:
                found[fields[name]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found


def _load_level(options: DecodeOptions, level: str, own_kernel: bool) -> Any:
    """Load `level` as a worker does and finish its after-ready work."""
    settings = ModelSettings(
        model=options.model,
        quantize=level,
        dtype=options.dtype,
        threads=options.threads,
        warmup=False,
        **({} if own_kernel else {"native_kernels": "off"}),
    )
    loaded = load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)
    loaded.settle()  # timed as a settled worker runs: kernel layouts and prompt copies made
    return loaded


def _first_load(options: DecodeOptions, level: str, own_kernel: bool) -> dict[str, Any]:
    """In a fresh process, untimed by the rounds: a load that makes the level's weight cache where it
    is missing (what the first start after a new release or checkpoint does, not a worker's usual start)."""
    started = time.perf_counter()
    loaded = _load_level(options, level, own_kernel)
    seconds = time.perf_counter() - started
    weights = sorted(str(path) for path in mapped_files(os.getpid()) if path.suffix == ".safetensors")
    return {"seconds": seconds, "rounded_layers": loaded.rounded_layers, "weight_files": weights}


def _measure_level(options: DecodeOptions, level: str, own_kernel: bool) -> dict[str, Any]:
    """In a fresh process: load `level` as a worker does, finish its after-ready work, time it."""
    loaded = _load_level(options, level, own_kernel)
    config = loaded.model.config
    weights = decode_weight_bytes(loaded.model)
    threads = options.threads or torch.get_num_threads()
    counts = (1, *options.batches)
    kv = {count: kv_bytes_read(config, count, options.prompt_tokens, options.tokens) for count in counts}
    prefill, steps, passes = {}, {}, {}
    with MemoryReader(threads, kernels=loaded.kernels) as reader:
        for count in counts:
            prefill[count], steps[count], passes[count] = _timings(
                loaded.model, options.tokens, options.prompt_tokens, count, reader
            )
    resident = _resident_bytes()  # with the reader's buffer unmapped
    every_pass = [speeds for count in counts for speeds in passes[count]]
    return {
        "batch_step_s": {count: statistics.median(steps[count]) for count in options.batches},
        "kv_bytes_per_step": kv,
        # the median step's share of its bound, each step against the memory's speed on both sides of it
        "of_bound": {
            count: statistics.median(step_shares(weights + kv[count], steps[count], passes[count])) for count in counts
        },
        "quantize": loaded.choices.quantize,
        "dtype": loaded.choices.dtype,
        "prefill_dtype": loaded.choices.prefill_dtype,
        "prefill_s": prefill[1],
        "step_s": statistics.median(steps[1]),
        "decode_bytes_per_token": weights,
        **resident,
        "read_bandwidth_bytes_per_s": statistics.median(max(speeds.values()) for speeds in every_pass),
        "read_bandwidth_readers": readers_medians(every_pass),
        "kernels": loaded.kernels.status,
        "rounded_layers": loaded.rounded_layers,
    }


def bench_decode(options: DecodeOptions) -> dict[str, Any]:
    turns = options.turns()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in turns}
    # One fresh process per level and round: the levels at once hold ~20 GB of the real-size model,
    # and on a 24 GB host the exact level's 12 GB slowed int8's steps from 44 to 61 ms.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn, max_tasks_per_child=1) as pool:
        first_loads = {label: pool.submit(_first_load, options, level, own).result() for label, level, own in turns}
        for number in range(options.rounds):
            for label, level, own_kernel in turns:
                prepared = None
                if options.cache_history:
                    history = options.cache_history[number % len(options.cache_history)]
                    prepared = pagehistory.prepare(map(Path, first_loads[label]["weight_files"]), history)
                run = pool.submit(_measure_level, options, level, own_kernel).result()
                runs[label].append(run | {"cache_history": prepared})
    result: dict[str, Any] = {
        "tokens": options.tokens,
        "rounds": options.rounds,
        "prompt_tokens": options.prompt_tokens,
        "levels": {},
    }
    for level, measured in runs.items():
        steps = [run["step_s"] for run in measured]
        prefills = [run["prefill_s"] for run in measured]
        resident = {
            name: [run[name] for run in measured if run[name] is not None] for name in ("rss_bytes", "rss_anon_bytes")
        }
        step = statistics.median(steps)
        result["levels"][level] = {
            **{
                name: measured[0][name]
                for name in ("quantize", "dtype", "prefill_dtype", "decode_bytes_per_token", "kernels")
            },
            "first_load": first_loads[level],
            "rounded_layers_in_rounds": max(run["rounded_layers"] for run in measured),
            "prefill_s": statistics.median(prefills),
            "prefill_s_range": [min(prefills), max(prefills)],
            "step_ms": step * 1e3,
            "step_ms_range": [min(steps) * 1e3, max(steps) * 1e3],
            "step_ms_rounds": [value * 1e3 for value in steps],
            "tokens_per_s": 1 / step,
            **{name: max(values) if values else None for name, values in resident.items()},
            "kv_bytes_per_step": {str(count): value for count, value in measured[0]["kv_bytes_per_step"].items()},
            "of_bound": _of_bound(measured, options.batches),
            **_by_history(measured),
            "batches": {
                str(count): {
                    "step_ms": statistics.median(run["batch_step_s"][count] for run in measured) * 1e3,
                    "step_ms_range": [
                        min(run["batch_step_s"][count] for run in measured) * 1e3,
                        max(run["batch_step_s"][count] for run in measured) * 1e3,
                    ],
                }
                for count in options.batches
            },
        }
    bandwidths = [run["read_bandwidth_bytes_per_s"] for measured in runs.values() for run in measured]
    result["read_bandwidth_bytes_per_s"] = statistics.median(bandwidths)
    result["read_bandwidth_range"] = [min(bandwidths), max(bandwidths)]
    result["read_bandwidth_readers"] = readers_medians(
        [run["read_bandwidth_readers"] for measured in runs.values() for run in measured]
    )
    # Against the first level: medians; each round's pair (the levels took turns, so a round's pair
    # saw the same machine); and the first level's best round, which stays honest when that level's
    # steps swing between rounds (this project's VMs did, for the exact level).
    first = result["levels"][turns[0][0]]
    for figures in result["levels"].values():
        figures["speedup"] = figures["tokens_per_s"] / first["tokens_per_s"]
        pairs = [a / b for a, b in zip(first["step_ms_rounds"], figures["step_ms_rounds"], strict=True)]
        figures["speedup_rounds_range"] = [min(pairs), max(pairs)]
        figures["speedup_vs_first_best"] = first["step_ms_range"][0] / figures["step_ms"]
    return result


def _by_history(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """With cache histories: each round's history (and the chunks it left in small pages before the
    load), each history's steps, and the spread of all rounds' steps (slowest over fastest, minus 1)."""
    if not any(run["cache_history"] for run in measured):
        return {}
    steps = [run["step_s"] * 1e3 for run in measured]
    histories: dict[str, list[float]] = {}
    for run, step in zip(measured, steps, strict=True):
        histories.setdefault(run["cache_history"]["history"], []).append(step)
    return {
        "cache_history_rounds": [run["cache_history"] for run in measured],
        "by_cache_history": {
            name: {"step_ms": statistics.median(values), "step_ms_range": [min(values), max(values)]}
            for name, values in histories.items()
        },
        "step_spread": max(steps) / min(steps) - 1,
    }


def readers_medians(turns: list[dict[str, float]]) -> dict[str, float]:
    """Each memory reader's median speed over the turns that had it: a turn on torch's kernels alone
    (`--kernels stock`) has torch's read and no other."""
    names = dict.fromkeys(name for speeds in turns for name in speeds)
    return {name: statistics.median(speeds[name] for speeds in turns if name in speeds) for name in names}


def of_bound(read_bytes: float, step_s: float, bandwidth: float) -> float:
    """The fraction of its memory-bandwidth bound a step reaches: the time its bytes (weights, and the
    keys and values its attention reads) take at `bandwidth`, over the step's time."""
    return read_bytes / bandwidth / step_s


def _of_bound(measured: list[dict[str, Any]], batches: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Per sequence count (1 and each batch): the median and range over the rounds of each round's
    median step share (`step_shares`)."""
    shares = {}
    for count in (1, *batches):
        values = [run["of_bound"][count] for run in measured]
        shares[str(count)] = {"median": statistics.median(values), "range": [min(values), max(values)]}
    return shares


def _resident(figures: dict[str, Any]) -> str:
    """A level's settled memory as the table shows it: all of it, then its anonymous part (`none` maps
    its weights from the checkpoint: its resident pages are mostly file pages)."""
    whole, anonymous = figures.get("rss_bytes"), figures.get("rss_anon_bytes")
    if whole is None:
        return ""
    return "%.1f GB" % (whole / 1e9) + ("" if anonymous is None else " (%.1f GB)" % (anonymous / 1e9))


def _history_line(level: str, figures: dict[str, Any]) -> str:
    """A level's steps per cache history, with the chunks each left in small pages before the loads."""
    parts = []
    for name, steps in figures["by_cache_history"].items():
        rounds = [r for r in figures["cache_history_rounds"] if r["history"] == name]
        low, high = min(r["small_chunks"] for r in rounds), max(r["small_chunks"] for r in rounds)
        small = str(low) if low == high else "%d-%d" % (low, high)
        parts.append(
            "%s %.1f ms (%.1f-%.1f; %s of %d chunks in small pages before the load)"
            % (name, steps["step_ms"], *steps["step_ms_range"], small, rounds[0]["chunks"])
        )
    return "%s, decode step by page-cache history: %s; spread over %d rounds %.0f%%" % (
        level,
        ", ".join(parts),
        len(figures["cache_history_rounds"]),
        100 * figures["step_spread"],
    )


def render(result: dict[str, Any]) -> str:
    counts = sorted({int(count) for figures in result["levels"].values() for count in figures.get("batches", {})})
    lines = [
        "| level | dtype | decode step (median, range of %d rounds) | tokens/s | vs first (medians; rounds; "
        "its best round) | GB read per token "
        "| of its bound | %s%d-token prompt | resident memory, settled (anonymous) |"
        % (
            result["rounds"],
            "".join("%d sequences: step (of its bound) | " % count for count in counts),
            result["prompt_tokens"],
        ),
        "|---|---|---|---|---|---|---|%s---|---|" % ("---|" * len(counts)),
    ]
    for level, f in result["levels"].items():
        bound = "%.0f%%" % (100 * f["of_bound"]["1"]["median"])
        batched = ""
        for count in counts:
            step = f["batches"][str(count)]["step_ms"]
            batched += "%.1f ms (%.0f%%) | " % (step, 100 * f["of_bound"][str(count)]["median"])
        row = "| %s | %s | %.1f ms (%.1f-%.1f) | %.2f | %.2fx; %.2f-%.2fx; %.2fx | %.2f | %s | "
        row += batched.replace("%", "%%") + "%.2f s (%s) | %s |"
        lines.append(
            row
            % (
                level,
                f["dtype"],
                f["step_ms"],
                *f["step_ms_range"],
                f["tokens_per_s"],
                f["speedup"],
                *f["speedup_rounds_range"],
                f["speedup_vs_first_best"],
                f["decode_bytes_per_token"] / 1e9,
                bound,
                f["prefill_s"],
                f["prefill_dtype"],
                _resident(f),
            )
        )
    for level, f in result["levels"].items():
        if "by_cache_history" in f:
            lines.append("\n" + _history_line(level, f))
    low, high = result["read_bandwidth_range"]
    readers = ", ".join("%s %.1f" % (name, speed / 1e9) for name, speed in result["read_bandwidth_readers"].items())
    lines.append(
        "\nmemory read speed, measured between each turn's steps: %.1f GB/s (%.1f-%.1f over the turns; the"
        " faster reader's; medians: %s)" % (result["read_bandwidth_bytes_per_s"] / 1e9, low / 1e9, high / 1e9, readers)
    )
    return "\n".join(lines)
