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

from vlserve.kvcache import new_cache
from vlserve.loader import load_model
from vlserve.settings import LimitSettings, ModelSettings


@dataclass(frozen=True)
class DecodeOptions:
    model: Path
    levels: tuple[str, ...] = ("none", "int8", "int4")
    tokens: int = 32
    rounds: int = 5
    threads: int | None = None
    dtype: str = "auto"  # what is not quantized (and the exact level): as the plan, or forced
    prompt_tokens: int = 256


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


def _timings(model: Any, tokens: int, prompt_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds of a `prompt_tokens` text prompt, decode step seconds), as the engine runs them:
    its growing KV cache, logits of the last position only."""
    cache = new_cache(model.config.text_config.num_hidden_layers)
    ids = torch.arange(100, 100 + prompt_tokens)[None]
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - started
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(tokens):
            started = time.perf_counter()
            out = model(input_ids=token, cache=out.cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - started)
    return prefill, times


def bench_decode(options: DecodeOptions) -> dict[str, Any]:
    loaded = {}
    for level in options.levels:
        settings = ModelSettings(
            model=options.model, quantize=level, dtype=options.dtype, threads=options.threads, warmup=False
        )
        loaded[level] = load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)
        loaded[level].settle()  # timed as a settled worker runs: kernel layouts and prompt copies made
    per_level: dict[str, list[float]] = {level: [] for level in options.levels}
    prefills: dict[str, list[float]] = {level: [] for level in options.levels}
    for _ in range(options.rounds):
        for level in options.levels:
            prefill, steps = _timings(loaded[level].model, options.tokens, options.prompt_tokens)
            per_level[level].append(statistics.median(steps))
            prefills[level].append(prefill)
    result: dict[str, Any] = {
        "tokens": options.tokens,
        "rounds": options.rounds,
        "prompt_tokens": options.prompt_tokens,
        "levels": {},
    }
    for level, medians in per_level.items():
        step = statistics.median(medians)
        result["levels"][level] = {
            "quantize": loaded[level].quantize,
            "dtype": loaded[level].dtype,
            "prefill_dtype": loaded[level].prefill_dtype,
            "prefill_s": statistics.median(prefills[level]),
            "prefill_s_range": [min(prefills[level]), max(prefills[level])],
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
        "| level | dtype | decode step (median, range of %d rounds) | tokens/s | vs first | GB read per token "
        "| of its bound | %d-token prompt |" % (result["rounds"], result["prompt_tokens"]),
        "|---|---|---|---|---|---|---|---|",
    ]
    for level, f in result["levels"].items():
        bound = (
            "" if bandwidth is None else "%.0f%%" % (100 * f["tokens_per_s"] * f["decode_bytes_per_token"] / bandwidth)
        )
        lines.append(
            "| %s | %s | %.1f ms (%.1f-%.1f) | %.2f | %.2fx | %.2f | %s | %.2f s (%s) |"
            % (
                level,
                f["dtype"],
                f["step_ms"],
                *f["step_ms_range"],
                f["tokens_per_s"],
                f["speedup"],
                f["decode_bytes_per_token"] / 1e9,
                bound,
                f["prefill_s"],
                f["prefill_dtype"],
            )
        )
    return "\n".join(lines)
