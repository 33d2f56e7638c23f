"""The text decoder's norms and rotary embedding through vlserve's native ops, where they are loaded.

A decode step of Qwen3-VL-2B ran ~2960 torch operations, and past its products their dispatch is
what costs (about 22 ms of an 85 ms int4 step on the 2-core build VM): transformers' RMSNorm is 8
operations (113 norms a step: two per layer, the per-head query and key norms, the final one) and
its rotary embedding 12 per layer. vlserve's library (kernels/decode_vnni.cpp) does each in one call
with the same roundings: rotary bit for bit, the norm within native.NORM_TOLERANCE (its float32 sum
of squares adds in another order: a few units in float32's last place, at most one in bfloat16's).
Measured on the build VM (2 threads, one token): a norm 21 -> 5 us, a layer's rotary 28 -> 9 us.
The attention's own op is chosen in vlserve.model.attention.

Used where the library serves the quantized levels (vlserve.kernels.native); elsewhere transformers' own
modules run.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_vl import modeling_qwen3_vl

from vlserve.kernels import native

# transformers' own function, whatever model/patches.py later puts in its place
STOCK_ROTARY = modeling_qwen3_vl.apply_rotary_pos_emb


class NativeRMSNorm(torch.nn.Module):
    """Qwen3VLTextRMSNorm in one call; holds the same weight parameter."""

    def __init__(self, norm: torch.nn.Module, op):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._op = op

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._op(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return "%s, eps=%s, native" % (tuple(self.weight.shape), self.variance_epsilon)


def rotary(q, k, cos, sin, unsqueeze_dim=1, *, op=None):
    """apply_rotary_pos_emb's signature: (batch, heads, tokens, dim) queries and keys, (batch, tokens,
    dim) tables, through `op` (native.Kernels.rotary, bound by model/patches.py); other layouts or
    dtypes, or no op, go to transformers' function."""
    if op is None or unsqueeze_dim != 1 or q.dtype != cos.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        return STOCK_ROTARY(q, k, cos, sin, unsqueeze_dim)
    return op(q, k, cos, sin)


def use_for(model: torch.nn.Module, kernels: native.Kernels) -> int:
    """Swap the language model's RMSNorms for the native op where `kernels` have it; returns how many
    norms were swapped (0: no library, nothing changed; else the caller applies the rotary too,
    model/patches.py)."""
    op = kernels.rms_norm()
    if op is None:
        return 0
    language_model = model.model.language_model
    swaps = [
        (parent, name, child)
        for parent in language_model.modules()
        for name, child in parent.named_children()
        if type(child) is modeling_qwen3_vl.Qwen3VLTextRMSNorm
    ]
    for parent, name, child in swaps:
        setattr(parent, name, NativeRMSNorm(child, op))
    return len(swaps)
