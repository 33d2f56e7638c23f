"""The model's attention: torch's `sdpa`, except where the queries are bfloat16 and vlserve's ops run.

A decode step (one query per sequence): torch 2.13's CPU flash-attention kernel (what `sdpa` runs
for bfloat16) repacks the whole key/value cache for its bfloat16 matrix kernel at every call.
Measured here (2 threads, Qwen3-VL-2B's 16 query heads over 8 key/value heads of 128): 420 us per
layer for one sequence over 300 cached tokens, 1.4 ms over 1000, 1.7 ms for four sequences over
300: 12 ms of a 65 ms int4 decode step. The same attention as two matrix products takes 98, 161 and
198 us. Its float32 path does not repack (43 us over 300), so float32 models and prompts keep `sdpa`.
Where vlserve's library is loaded (vlserve.kernels.native: AVX-512 hosts), the same computation runs
as one op that reads the bfloat16 keys and values where they lie (no widened copy), equal to the
Python path here within a unit of bfloat16 (its float32 sums add in another order, which may move a
rounding; most values are equal bit for bit: tests/test_native.py).

A prompt or an image (many queries): on CPUs without AMX the flash kernel multiplies in float32, so
where the CPU runs bfloat16 products (AVX-512 BF16) kernels/prompt_attention.cpp does: a vision
layer's 720 patches (16 heads of 64) took 4.2 ms against sdpa's 13.6 on a 2-vCPU Zen 5, a
220-token prompt's layer 1.2 against 2.6. The language model and the vision tower both attend
through here (model/decoderops.attend_with); float32 towers keep `sdpa`.

Rounding as the flash kernel rounds: scores are float32 products (a bfloat16 product would round
each score to 8 bits of mantissa; the keys are widened to float32, a chunk of the batch at a time so
the temporary stays small), softmax in float32, probabilities rounded to the values' dtype for the
second product, which accumulates in float32.
"""

from __future__ import annotations

import torch

from vlserve.kernels import native
from vlserve.kernels.reference import one_query_attention


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    kernels: native.Kernels = native.STOCK_KERNELS,
    scaling: float | None = None,
    is_causal: bool | None = None,
) -> tuple[torch.Tensor, None]:
    """query (B, H, Q, D), key/value (B, KV, T, D) -> (B, Q, H, D), as transformers' attention
    interface takes them; `kernels` bound per model at load (model/decoderops.attend_with)."""
    if query.dtype != torch.float32:
        contiguous = key.stride(-1) == value.stride(-1) == query.stride(-1) == 1
        if query.shape[2] == 1:
            op = kernels.one_query_attention()
            if op is not None and contiguous and query.shape[-1] % 16 == 0:
                return op(
                    query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling
                ), None
            return one_query_attention(query, key, value, attention_mask, scaling=scaling), None
        op = kernels.prompt_attention()
        if op is not None and contiguous and _prompt_op_takes(query, key, attention_mask):
            mask, keys = _prompt_mask(module, query, attention_mask, is_causal)
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            return op(query, key[:, :, :keys], value[:, :, :keys], mask, scale), None
    return sdpa(module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal), None


def sdpa(module, query, key, value, mask, *, scaling: float | None, is_causal: bool | None) -> torch.Tensor:
    """torch's scaled_dot_product_attention as transformers' `sdpa` attention calls it (5.24): grouped
    key/value heads shared without a copy where no mask is given, a lone query's heads folded onto
    its key/value heads where one is, causal only for a prompt without a mask (aligned to its first
    key, so only as many keys as queries)."""
    groups = getattr(module, "num_key_value_groups", 1)
    queries = query.shape[2]
    options = {}
    if groups > 1:
        if mask is None and key.shape[-1] == value.shape[-1] <= 256:
            options["enable_gqa"] = True
        elif queries == 1:
            batch, heads, _, dim = query.shape
            query = query.reshape(batch, heads // groups, groups, dim)
            mask = mask if mask.shape[1] == 1 else mask.reshape(batch, heads // groups, groups, -1)
        else:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    causal = queries > 1 and mask is None and (is_causal if is_causal is not None else module.is_causal)
    if causal and key.shape[2] > queries:
        key, value = key[:, :, :queries], value[:, :, :queries]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, is_causal=causal, **options
    )
    return out.reshape(out.shape[0], -1, queries, value.shape[-1]).transpose(1, 2).contiguous()


def _prompt_op_takes(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the prompt op's shapes take these (kernels.native.Kernels.prompt_attention)."""
    shapes = query.dtype == torch.bfloat16 and query.shape[-1] % native.PROMPT_ATTENTION_DIM_MULTIPLE == 0
    return shapes and (
        mask is None or (mask.dim() == 4 and mask.shape[-1] == key.shape[2] and mask.shape[2] in (1, query.shape[2]))
    )


def _prompt_mask(module, query: torch.Tensor, mask: torch.Tensor | None, is_causal: bool | None):
    """The mask the prompt op takes, as sdpa_attention_forward reads its arguments: no mask and a
    causal module (or is_causal) is a causal mask aligned to the first key, over as many keys as
    queries; and that many keys (None: all)."""
    if mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        length = query.shape[2]
        return torch.ones(length, length, dtype=torch.bool).tril_()[None, None], length
    if mask is not None and (mask.dtype not in {torch.bool, torch.float32} or mask.stride(-1) != 1):
        mask = mask.float().contiguous()
    return mask, None
