"""The tensors of the sequences being decoded together, and how sequences join and leave.

Continuous batching on one model: every decode step feeds one token per running sequence. A new
group of requests is prefilled on its own, then merged into the running batch by left-padding
the shorter KV cache (padded slots are masked out); finished sequences are dropped by selecting
rows, and columns that every remaining row masks out are trimmed away.

Positions are explicit, never taken from the model's own `rope_deltas` state: each row carries
the count of its real tokens (the text position) and its M-RoPE delta (how far Qwen3-VL's 3-D
vision positions run ahead of the text position), so left padding never shifts a position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlserve.runtime.kvcache import Cache, cache_bytes, new_cache


@dataclass
class BatchState:
    cache: Cache
    attention_mask: torch.Tensor  # [B, L] 1 for real tokens, 0 for padding
    text_positions: torch.Tensor  # [B] position of the next token fed for each row
    rope_deltas: torch.Tensor  # [B] M-RoPE delta of each row
    next_tokens: torch.Tensor  # [B] the token each row feeds at the next step

    @property
    def size(self) -> int:
        return int(self.attention_mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.attention_mask.shape[1])

    @property
    def kv_bytes(self) -> int:
        """What the batch's key/value buffers hold (the running sequences' share of the planned cache)."""
        return cache_bytes(self.cache)

    def step_inputs(self) -> dict:
        """Model inputs for one decode step: one token per row."""
        mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(self.size, 1)], dim=1)
        text = self.text_positions.view(1, -1, 1)
        vision = (self.text_positions + self.rope_deltas).view(1, -1, 1).expand(3, -1, -1)
        return {
            "input_ids": self.next_tokens.view(-1, 1),
            "attention_mask": mask,
            "position_ids": torch.cat([text, vision], dim=0),
            "cache": self.cache,
        }

    def advance(self, new_mask: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """After a decode step: the fed tokens are in the cache now."""
        self.attention_mask = new_mask
        self.text_positions = self.text_positions + 1
        self.next_tokens = next_tokens

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished or cancelled sequences leave)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache = _rebuild(self.cache, lambda t: t.index_select(0, index))
        self.attention_mask = self.attention_mask.index_select(0, index)
        self.text_positions = self.text_positions.index_select(0, index)
        self.rope_deltas = self.rope_deltas.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that every row masks out (left by rows that have left)."""
        used = self.attention_mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.length
        if start > 0:
            self.attention_mask = self.attention_mask[:, start:]
            self.cache = _rebuild(self.cache, lambda t: t[:, :, start:, :])

    def merge(self, other: BatchState) -> None:
        """Append another batch's rows, left-padding whichever is shorter."""
        length = max(self.length, other.length)
        self.cache = _concat_caches(self.cache, self.length, other.cache, other.length, length)
        self.attention_mask = torch.cat(
            [_pad_left(self.attention_mask, length, dim=1), _pad_left(other.attention_mask, length, dim=1)], dim=0
        )
        self.text_positions = torch.cat([self.text_positions, other.text_positions])
        self.rope_deltas = torch.cat([self.rope_deltas, other.rope_deltas])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _rebuild(cache: Cache, change) -> Cache:
    return new_cache(len(cache.layers), [(change(k), change(v)) for k, v in _layers(cache)])


def _concat_caches(a: Cache, a_len: int, b: Cache, b_len: int, length: int) -> Cache:
    merged = []
    for (ak, av), (bk, bv) in zip(_layers(a), _layers(b), strict=True):
        merged.append(
            (
                torch.cat([_pad_left(ak, length, 2), _pad_left(bk, length, 2)], dim=0),
                torch.cat([_pad_left(av, length, 2), _pad_left(bv, length, 2)], dim=0),
            )
        )
    return new_cache(len(merged), merged)
