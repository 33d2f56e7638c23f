"""What a quantize level's rounding costs, measured on a checkpoint: `vlserve quant-check`.

The same image+question prompts go through the exact model (the checkpoint's bfloat16 weights, its
vision tower too) and through the model at each level as a worker serves it: loaded by the service's
own loader with the plan's choices for this host (the vision tower in int8 where the level rounds it,
the int4 level's int8 prompt copies), settled as a worker is after its start, and run as a worker runs
it: the prompt in one pass through the prompt paths, then the answer one token at a time through the
decode paths. The exact model answers greedily; each level is then fed those same answer tokens
(forced), and at every answer position their next-token distributions are compared: how often the
most likely token agrees, and the mean KL divergence KL(exact || level) in nats, the figure
llama.cpp's `perplexity --kl-divergence` reports for its quantization types. Each level's row says
which ISA and kernels it ran on: the figures hold for that path (docs/quantization.md).
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlserve.bench.workload import QUESTIONS, synthetic_photo
from vlserve.kernels import native
from vlserve.model.loader import load_model
from vlserve.model.network import prompt_pass, prompt_positions
from vlserve.runtime.kvcache import new_cache
from vlserve.settings import LimitSettings, ModelSettings
from vlserve.sizing.contract import QUANTIZED_LEVELS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckOptions:
    model: Path
    levels: tuple[str, ...] = QUANTIZED_LEVELS
    prompts: int = 4
    answer_tokens: int = 32
    image_size: tuple[int, int] = (448, 448)
    images: tuple[Path, ...] = ()  # the user's own images (else generated photos)
    threads: int | None = None
    exact_vision: bool = False  # keep the vision tower exact at every level: the language model's rounding alone


def _inputs(processor: Any, image: bytes, question: str) -> dict[str, torch.Tensor]:
    from PIL import Image  # noqa: PLC0415

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=[picture], return_tensors="pt"))


def _load(options: CheckOptions, quantize: str):
    exact = quantize == "none"
    settings = ModelSettings(
        model=options.model,
        quantize=quantize,
        dtype="bfloat16",
        # The exact model: the checkpoint's weights everywhere, through torch's own products.
        vision_dtype="bfloat16" if exact or options.exact_vision else "auto",
        prefill_dtype="bfloat16" if exact else "auto",
        packed_weights=False if exact else None,
        threads=options.threads,
        warmup=False,
    )
    loaded = load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)
    loaded.settle()  # as a worker runs once its start-up work is done: prompt copies made
    return loaded


def _answer_log_probs(model: Any, inputs: dict[str, torch.Tensor], answer: torch.Tensor | None, tokens: int):
    """(the answer's tokens, log-probabilities of the next token at each answer position): greedy when
    `answer` is None, else forced to `answer`, one decode step a token after the prompt's pass."""
    prompt = inputs["input_ids"].shape[1]
    _, delta = prompt_positions(model, inputs)
    chosen, logits = [], []
    with torch.inference_mode():
        out = prompt_pass(model, inputs, new_cache(model.config.text_config.num_hidden_layers), logits_to_keep=1)
        for step in range(tokens):
            row = out.logits[0, -1].float()  # the raw logits of this answer position
            logits.append(row)
            chosen.append(int(answer[step]) if answer is not None else int(row.argmax()))
            if step + 1 < tokens:
                position = prompt + step
                positions = torch.tensor([position] + [position + delta] * 3).view(4, 1, 1)
                out = model(torch.tensor([[chosen[-1]]]), None, positions, out.cache, logits_to_keep=1)
    return torch.tensor(chosen), torch.stack(logits).log_softmax(-1)


def ran_on(loaded) -> dict[str, str]:
    """Which ISA and kernels a level ran on, as quant-check reports it."""
    tier = loaded.kernels.tier
    return {
        "isa": native.TIER_NAMES.get(tier, "none") if tier else "torch at %s" % torch.backends.cpu.get_cpu_capability(),
        "kernels": loaded.kernels.status,
        "vision_dtype": loaded.choices.vision_dtype,
        "prefill_dtype": loaded.choices.prefill_dtype,
    }


def quant_check(options: CheckOptions) -> dict[str, Any]:
    """{'prompts', 'answer_tokens', 'cpu_capability', 'levels': {level: {'agreement', 'kl_mean',
    'kl_prompt_means', 'kl_median', 'kl_p99', 'kl_max', 'positions', 'load_s', 'isa', 'kernels', 'vision_dtype',
    'prefill_dtype'}}}."""
    images = [image.read_bytes() for image in options.images] or [
        synthetic_photo(*options.image_size, seed=7000 + i) for i in range(options.prompts)
    ]
    exact = _load(options, "none")
    cases = []
    for index, image in enumerate(images):
        inputs = _inputs(exact.processor, image, QUESTIONS[index % len(QUESTIONS)])
        answer, reference = _answer_log_probs(exact.model, inputs, None, options.answer_tokens)
        cases.append((inputs, answer, reference))
    del exact
    result: dict[str, Any] = {
        "prompts": len(cases),
        "answer_tokens": options.answer_tokens,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "levels": {},
    }
    for level in options.levels:
        started = time.monotonic()
        rounded = _load(options, level)
        load_s = time.monotonic() - started
        agree, total, divergences = 0, 0, []
        for inputs, answer, reference in cases:
            _, candidate = _answer_log_probs(rounded.model, inputs, answer, options.answer_tokens)
            agree += int((candidate.argmax(-1) == reference.argmax(-1)).sum())
            total += reference.shape[0]
            divergences.append((reference.exp() * (reference - candidate)).sum(-1).clamp(min=0))
        kl = torch.cat(divergences)
        per_prompt = [float(d.mean()) for d in divergences]
        result["levels"][level] = {
            "quantize": rounded.choices.quantize,
            "agreement": agree / total,
            "kl_mean": float(kl.mean()),
            "kl_prompt_means": per_prompt,  # the spread: a few sensitive positions can carry the mean
            "kl_median": float(kl.median()),
            "kl_p99": float(kl.quantile(0.99)),
            "kl_max": float(kl.max()),
            "positions": total,
            "load_s": round(load_s, 2),
            **ran_on(rounded),
        }
        del rounded
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        "%d prompts x %d answer tokens against the exact weights (answers forced, decoded a token at a time)"
        % (result["prompts"], result["answer_tokens"]),
        "| level | next-token agreement | mean KL (nats; prompts' range) | median | p99 | max | ran on | vision, "
        "prompts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level, figures in result["levels"].items():
        lines.append(
            "| %s | %.1f%% | %.4f (%.4f-%.4f) | %.4f | %.3f | %.3f | %s | %s, %s |"
            % (
                level,
                100 * figures["agreement"],
                figures["kl_mean"],
                min(figures["kl_prompt_means"]),
                max(figures["kl_prompt_means"]),
                figures["kl_median"],
                figures["kl_p99"],
                figures["kl_max"],
                figures["isa"],
                figures["vision_dtype"],
                figures["prefill_dtype"],
            )
        )
    lines.append("kernels: %s" % next(iter(result["levels"].values()), {}).get("kernels", "-"))
    return "\n".join(lines)
