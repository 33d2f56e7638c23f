"""Choosing the next token of each row: greedy, or temperature + top-p with a per-request seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __post_init__(self) -> None:
        if not self.greedy:
            self.generator = torch.Generator()
            if self.seed is not None:
                self.generator.manual_seed(self.seed)
            else:
                self.generator.seed()


def next_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, V] of the model's dtype -> token ids [B]; greedy rows take the argmax in one call.
    In float32: torch's argmax over 151936 bfloat16 logits took 500 us a row here, the conversion and
    a float32 argmax 154 us."""
    logits = logits.float()
    chosen = logits.argmax(dim=-1)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        chosen[row] = torch.multinomial(probs, 1, generator=p.generator)[0]
    return chosen
