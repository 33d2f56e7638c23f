"""The language model's attention: torch's `sdpa`, except for a decode step in bfloat16.

At one query per sequence, torch 2.13's CPU flash-attention kernel (what `sdpa` runs for bfloat16)
repacks the whole key/value cache for its bfloat16 matrix kernel at every call. Measured here (2
threads, Qwen3-VL-2B's 16 query heads over 8 key/value heads of 128): 420 us per layer for one
sequence over 300 cached tokens, 1.4 ms over 1000, 1.7 ms for four sequences over 300: 12 ms of a
65 ms int4 decode step. The same attention as two matrix products takes 98, 161 and 198 us. Its
float32 path does not repack (43 us over 300), so float32 models and prompts keep `sdpa`.

Where vlserve's library is loaded (vlserve.kernels.native: the quantized levels on AVX-512 hosts), the same
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
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlserve.kernels import native
from vlserve.kernels.reference import one_query_attention

NAME = "vlserve"  # what the text model's config names as its attention implementation


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    kernels: native.Kernels = native.STOCK_KERNELS,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, Q, D), key/value (B, KV, T, D) -> (B, Q, H, D);
    `kernels` bound at registration (model/patches.py)."""
    if query.shape[2] != 1 or query.dtype == torch.float32 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    op = kernels.one_query_attention()
    if op is not None and key.stride(-1) == value.stride(-1) == query.stride(-1) == 1 and query.shape[-1] % 16 == 0:
        return op(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    return one_query_attention(query, key, value, attention_mask, scaling=scaling), None
