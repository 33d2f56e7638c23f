"""The language model's attention: torch's `sdpa`, except for a decode step in bfloat16.

At one query per sequence, torch 2.13's CPU flash-attention kernel (what `sdpa` runs for bfloat16)
repacks the whole key/value cache for its bfloat16 matrix kernel at every call. Measured here (2
threads, Qwen3-VL-2B's 16 query heads over 8 key/value heads of 128): 420 us per layer for one
sequence over 300 cached tokens, 1.4 ms over 1000, 1.7 ms for four sequences over 300: 12 ms of a
65 ms int4 decode step. The same attention as two matrix products takes 98, 161 and 198 us. Its
float32 path does not repack (43 us over 300), so float32 models and prompts keep `sdpa`.

Where vlserve's library is loaded (vlserve.native: the quantized levels on AVX-512 hosts), the same
computation runs as one op that reads the bfloat16 keys and values where they lie (no widened copy),
equal to the Python path here within a unit of bfloat16 (its float32 sums add in another order,
which may move a rounding; most values are equal bit for bit: tests/test_native.py).

Rounding as the flash kernel rounds: scores are float32 products (a bfloat16 product would round
each score to 8 bits of mantissa; the keys are widened to float32, a chunk of the batch at a time so
the temporary stays small), softmax in float32, probabilities rounded to the values' dtype for the
second product, which accumulates in float32.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlserve import native

NAME = "vlserve"  # what the text model's config names as its attention implementation
WIDENED_KEYS_BYTES = 16 << 20  # float32 keys widened at a time: reused heap memory, not a fresh mmap per call


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, Q, D), key/value (B, KV, T, D) -> (B, Q, H, D)."""
    if query.shape[2] != 1 or query.dtype == torch.float32 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    op = native.one_query_attention()
    if op is not None and key.stride(-1) == value.stride(-1) == query.stride(-1) == 1 and query.shape[-1] % 16 == 0:
        return op(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    return one_query_attention(query, key, value, attention_mask, scaling=scaling), None


def one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *, scaling: float | None
) -> torch.Tensor:
    """One query per sequence: (B, H, 1, D) over (B, KV, T, D) -> (B, 1, H, D). `mask` as sdpa takes it:
    None, boolean (True attends) or additive, broadcastable to (B, 1, 1, T)."""
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    # Query heads sharing a key/value head become rows of one product (grouped-query attention).
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).to(torch.float32, copy=True).mul_(scale)
    chunk = max(1, WIDENED_KEYS_BYTES // (kv_heads * length * dim * 4))
    parts = [
        torch.matmul(grouped[start : start + chunk], key[start : start + chunk].float().transpose(-1, -2))
        for start in range(0, batch, chunk)
    ]
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, length)
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, heads, dim)


def use_for(model: torch.nn.Module) -> None:
    """Make the language model of a loaded Qwen3-VL attend through `attention` (the vision tower keeps its own)."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa
    model.config.text_config._attn_implementation = NAME
