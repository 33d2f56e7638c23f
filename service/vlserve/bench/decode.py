"""Single-stream decode speed at each quantize level, measured side by side: `vlserve bench-decode`.

Every level's model is loaded by the service's loader into this one process, then the levels take
turns (round after round, so the machine's drift falls on all of them alike): a fixed prompt is
prefilled once and `tokens` greedy steps are timed one by one through the model's KV cache. Beside
each level's tokens/s: its bytes read per token (`decode_weight_bytes`) and, with the machine's read
bandwidth, the fraction of its own bandwidth bound it reaches.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlserve.loader import load_model
from vlserve.settings import LimitSettings, ModelSettings


@dataclass(frozen=True)
class DecodeOptions:
    model: Path
    levels: tuple[str, ...] = ("none", "int8", "int4")
    tokens: int = 32
    rounds: int = 5
    threads: int | None = None


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


def _step_times(model: Any, tokens: int) -> list[float]:
    ids = torch.arange(100, 164)[None]
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(tokens):
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - started)
    return times


def bench_decode(options: DecodeOptions) -> dict[str, Any]:
    loaded = {}
    for level in options.levels:
        settings = ModelSettings(model=options.model, quantize=level, threads=options.threads, warmup=False)
        loaded[level] = load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)
        for step in loaded[level].map_copies:  # as a settled worker: nothing left in the checkpoint's map
            step()
    per_level: dict[str, list[float]] = {level: [] for level in options.levels}
    for _ in range(options.rounds):
        for level in options.levels:
            per_level[level].append(statistics.median(_step_times(loaded[level].model, options.tokens)))
    result: dict[str, Any] = {"tokens": options.tokens, "rounds": options.rounds, "levels": {}}
    for level, medians in per_level.items():
        step = statistics.median(medians)
        result["levels"][level] = {
            "quantize": loaded[level].quantize,
            "dtype": loaded[level].dtype,
            "step_ms": step * 1e3,
            "step_ms_range": [min(medians) * 1e3, max(medians) * 1e3],
            "tokens_per_s": 1 / step,
            "decode_bytes_per_token": decode_weight_bytes(loaded[level].model),
        }
    base = result["levels"][options.levels[0]]["tokens_per_s"]
    for figures in result["levels"].values():
        figures["speedup"] = figures["tokens_per_s"] / base
    return result


def render(result: dict[str, Any], bandwidth: float | None = None) -> str:
    lines = [
        "| level | step (median, range of %d rounds) | tokens/s | vs first | GB read per token | of its bound |"
        % result["rounds"],
        "|---|---|---|---|---|---|",
    ]
    for level, f in result["levels"].items():
        bound = (
            "" if bandwidth is None else "%.0f%%" % (100 * f["tokens_per_s"] * f["decode_bytes_per_token"] / bandwidth)
        )
        lines.append(
            "| %s | %.1f ms (%.1f-%.1f) | %.2f | %.2fx | %.2f | %s |"
            % (
                level,
                f["step_ms"],
                *f["step_ms_range"],
                f["tokens_per_s"],
                f["speedup"],
                f["decode_bytes_per_token"] / 1e9,
                bound,
            )
        )
    return "\n".join(lines)
