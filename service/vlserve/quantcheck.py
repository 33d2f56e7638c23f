"""What a quantize level's rounding costs, measured on a checkpoint: `vlserve quant-check`.

The same image+question prompts go through the exact model (plain weights in the checkpoint's dtype)
and through the model at each level, loaded by the service's own loader. The exact model answers
greedily; then both read that whole conversation in one pass (teacher forcing) and, at every answer
position, their next-token distributions are compared: how often the most likely token agrees, and
the mean KL divergence KL(exact || quantized) in nats, the figure llama.cpp's `perplexity
--kl-divergence` reports for its quantization types.
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
from vlserve.loader import load_model
from vlserve.settings import LimitSettings, ModelSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckOptions:
    model: Path
    levels: tuple[str, ...] = ("int8", "int4")
    prompts: int = 4
    answer_tokens: int = 32
    image_size: tuple[int, int] = (448, 448)
    images: tuple[Path, ...] = ()  # the user's own images (else generated photos)
    threads: int | None = None


def _inputs(processor: Any, image: bytes, question: str) -> dict[str, torch.Tensor]:
    from PIL import Image  # noqa: PLC0415

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=[picture], return_tensors="pt"))


def _load(options: CheckOptions, quantize: str):
    settings = ModelSettings(
        model=options.model,
        quantize=quantize,
        dtype="bfloat16",
        vision_dtype="bfloat16",  # the vision tower stays exact: this measures the language model's rounding
        prefill_dtype="bfloat16" if quantize == "none" else quantize,
        packed_weights=False,
        threads=options.threads,
        warmup=False,
    )
    return load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)


def _answer_log_probs(model: Any, inputs: dict[str, torch.Tensor], sequence: torch.Tensor, prompt_tokens: int):
    """Log-probabilities of the next token at each answer position, reading the whole sequence at once."""
    forced = dict(inputs, input_ids=sequence[None])
    forced["attention_mask"] = torch.ones_like(forced["input_ids"])
    if "mm_token_type_ids" in inputs:
        extra = sequence.shape[0] - inputs["mm_token_type_ids"].shape[1]
        forced["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, extra))
    with torch.inference_mode():
        logits = model(**forced).logits[0, prompt_tokens - 1 : -1].float()
    return logits.log_softmax(-1)


def quant_check(options: CheckOptions) -> dict[str, Any]:
    """{'prompts', 'answer_tokens', 'levels': {level: {'agreement', 'kl_mean', 'kl_max', 'load_s'}}}."""
    images = [path.read_bytes() for path in options.images] or [
        synthetic_photo(*options.image_size, seed=7000 + i) for i in range(options.prompts)
    ]
    exact = _load(options, "none")
    cases = []
    for index, image in enumerate(images):
        inputs = _inputs(exact.processor, image, QUESTIONS[index % len(QUESTIONS)])
        prompt_tokens = int(inputs["input_ids"].shape[1])
        with torch.inference_mode():
            generated = exact.model.generate(
                **inputs, max_new_tokens=options.answer_tokens, do_sample=False, min_new_tokens=options.answer_tokens
            )[0]
        reference = _answer_log_probs(exact.model, inputs, generated, prompt_tokens)
        cases.append((inputs, generated, prompt_tokens, reference))
    del exact
    result: dict[str, Any] = {"prompts": len(cases), "answer_tokens": options.answer_tokens, "levels": {}}
    for level in options.levels:
        started = time.monotonic()
        rounded = _load(options, level)
        load_s = time.monotonic() - started
        agree, total, divergences = 0, 0, []
        for inputs, generated, prompt_tokens, reference in cases:
            candidate = _answer_log_probs(rounded.model, inputs, generated, prompt_tokens)
            agree += int((candidate.argmax(-1) == reference.argmax(-1)).sum())
            total += reference.shape[0]
            divergences.append((reference.exp() * (reference - candidate)).sum(-1))
        kl = torch.cat(divergences)
        result["levels"][level] = {
            "quantize": rounded.quantize,
            "agreement": agree / total,
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "positions": total,
            "load_s": round(load_s, 2),
        }
        del rounded
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        "%d prompts x %d answer tokens, against the exact weights (teacher forcing)"
        % (result["prompts"], result["answer_tokens"]),
        "| level | next-token agreement | mean KL (nats) | max KL |",
        "|---|---|---|---|",
    ]
    for level, figures in result["levels"].items():
        lines.append(
            "| %s | %.1f%% | %.4f | %.3f |" % (level, 100 * figures["agreement"], figures["kl_mean"], figures["kl_max"])
        )
    return "\n".join(lines)
