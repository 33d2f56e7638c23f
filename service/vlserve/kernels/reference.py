"""Python references for vlserve's kernels: what each op computes, written with torch's own ops.

The kernels' self-checks (native.py) compare a fresh build against them, the tests compare the
served ops with them, and the attention falls back to `one_query_attention` where its op is not loaded.
"""

from __future__ import annotations

import torch

from vlserve.kernels.formats import Q8_BLOCK, quantize_blocks

WIDENED_KEYS_BYTES = 16 << 20  # float32 keys widened at a time: reused heap memory, not a fresh mmap per call


def q8_reference(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """kernels/q8.cpp's product in float64: rows rounded per block, integer sums per block, each times
    its two scales (float32, as the kernel multiplies them), summed (the kernel in float32)."""
    q, row_scales = quantize_blocks(rows)
    outputs, columns = values.shape
    blocks = columns // Q8_BLOCK
    sums = torch.einsum(
        "rgk,ogk->rog",
        q.double().reshape(-1, blocks, Q8_BLOCK),
        values.double().reshape(outputs, blocks, Q8_BLOCK),
    )
    factors = (scales.float()[None] * row_scales[:, None]).double()  # (rows, outputs, blocks)
    out = (sums * factors).sum(-1)
    return out if bias is None else out + bias.double()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-VL's RMSNorm as transformers computes it (model/network.py runs this): the mean square
    in float32, the scaled value rounded back to the input's dtype before the weight multiplies it."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


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


def prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *, scaling: float | None
) -> torch.Tensor:
    """Many queries: (B, H, Q, D) over (B, KV, T, D) -> (B, Q, H, D), rounded as kernels/prompt_attention.cpp
    rounds: float32 scores (exact products, summed here in float64), float32 softmax, probabilities
    rounded to the values' dtype, their products with the values summed (float64 here) and rounded
    to it. `mask` as sdpa takes it, broadcastable to (B, H, Q, T); a query with no key to attend to gets zeros."""
    group = query.shape[1] // key.shape[1]
    key, value = (tensor.repeat_interleave(group, dim=1) for tensor in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.double() @ key.double().transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(value.dtype)  # NaN: every key masked
    return (weights.double() @ value.double()).to(value.dtype).transpose(1, 2).contiguous()
