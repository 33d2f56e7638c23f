"""The text decoder's norms and rotary embedding through vlserve's native ops, where they are loaded.

A decode step of Qwen3-VL-2B ran ~2960 torch operations, and past its products their dispatch is
what costs (about 22 ms of an 85 ms int4 step on the 2-core build VM): transformers' RMSNorm is 8
operations (113 norms a step: two per layer, the per-head query and key norms, the final one) and
its rotary embedding 12 per layer. vlserve's library (kernels/decode_vnni.cpp) does each in one call
with the same roundings: rotary bit for bit, the norm within checks.NORM_TOLERANCE (its float32 sum
of squares adds in another order: a few units in float32's last place, at most one in bfloat16's).
Measured on the build VM (2 threads, one token): a norm 21 -> 5 us, a layer's rotary 28 -> 9 us.
The attention's own op is chosen in vlserve.model.attention.

Past those, a decode step's layer still ran ~25 small operations from Python (views, splits, the
cache's writes, residual adds, SiLU) at 5-7 us each: about 6 ms of a 32 ms int4 step on a 2-vCPU Zen 5.
Where the AVX-512 VNNI tier loads, each decoder layer whose weights are in a format the layer op takes
(`_product`) runs its decode steps (one token a row, up to MAX_ROWS rows) as one call
(kernels/decoder_layer.cpp: the same operations in C++, bit for bit); prompts, and layers it does not
take, run transformers' forward.

Used where the library serves the quantized levels (vlserve.kernels.native); elsewhere the network's
own modules (model/network.py) run as they are. Everything here is done to one model's own instances.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vlserve.kernels import native
from vlserve.kernels.quantized import INT8_PREFILL_ROWS, ExactChannels, Int4Weight, Int8Weight
from vlserve.model import attention, network
from vlserve.model.packing import PREFILL_ROWS, NativeBf16Weight, PackedLinear

STOCK_ROTARY = network.apply_rotary
# Rows a decode step's layer takes: PackedLinear.forward sends fewer than INT8_PREFILL_ROWS and
# PREFILL_ROWS rows to the decode weights, and NativeBf16Weight up to native.MAX_ROWS to its own product.
MAX_ROWS = min(INT8_PREFILL_ROWS - 1, PREFILL_ROWS - 1, native.MAX_ROWS)
BF16, Q8, INT4 = 0, 1, 2  # the product kinds, as kernels/decoder_layer.cpp numbers them
EXACT_PARTS = ("columns", "column_weights", "rows", "row_weights", "row_bias")  # quantized.ExactChannels'


def attend_with(model: torch.nn.Module, kernels: native.Kernels) -> None:
    """The language model's and the vision tower's attention modules attend on `kernels`."""
    for module in model.modules():
        if isinstance(module, (network.TextAttention, network.VisionAttention)):
            module.attend = functools.partial(attention.attention, kernels=kernels)


def decode_with(model: torch.nn.Module, kernels: native.Kernels) -> None:
    """The language model's norms and rotary embedding through vlserve's ops, where `kernels` have
    them, and its decoder layers' decode steps through the layer op where it takes them."""
    if use_for(model, kernels):
        rotary = functools.partial(rotary_op, op=kernels.rotary())
        for layer in model.model.language_model.layers:
            layer.self_attn.rotary = rotary
        vision_rotary = functools.partial(vision_rotary_op, op=kernels.rotary())
        for block in model.model.visual.blocks:
            block.attn.rotary = vision_rotary
        use_decoder_layers(model, kernels)


class NativeRMSNorm(torch.nn.Module):
    """network.RMSNorm in one call; holds the same weight parameter."""

    def __init__(self, norm: torch.nn.Module, op):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._op = op

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._op(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return "%s, eps=%s, native" % (tuple(self.weight.shape), self.variance_epsilon)


def rotary_op(q, k, cos, sin, unsqueeze_dim=1, *, op=None):
    """network.apply_rotary's signature: (batch, heads, tokens, dim) queries and keys, (batch, tokens,
    dim) tables, through `op` (native.Kernels.rotary, bound by `decode_with`); other layouts or
    dtypes, or no op, go to the network's own function."""
    if op is None or unsqueeze_dim != 1 or q.dtype != cos.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        return STOCK_ROTARY(q, k, cos, sin, unsqueeze_dim)
    return op(q, k, cos, sin)


def vision_rotary_op(q, k, cos, sin, *, op=None):
    """network.apply_vision_rotary's signature, (tokens, heads, dim) bfloat16 queries and keys and
    (tokens, dim) float32 tables, through `op` (native.Kernels.rotary, bound by `decode_with`), to the
    bit: 1.7 ms a layer of the vision tower in ATen's 12 calls. Returned as (tokens, heads, dim) views
    of (heads, tokens, dim) results, the layout the attention reads next; other dtypes, or no op, go
    to the network's own function."""
    if op is None or q.dtype != torch.bfloat16 or cos.dtype != torch.float32:
        return network.apply_vision_rotary(q, k, cos, sin)
    q, k = op(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def use_for(model: torch.nn.Module, kernels: native.Kernels) -> int:
    """Swap the language model's RMSNorms for the native op where `kernels` have it; returns how many
    norms were swapped (0: no library, nothing changed; else the caller applies the rotary too,
    `decode_with`)."""
    op = kernels.rms_norm()
    if op is None:
        return 0
    language_model = model.model.language_model
    swaps = [
        (parent, name, child)
        for parent in language_model.modules()
        for name, child in parent.named_children()
        if type(child) is network.RMSNorm
    ]
    for parent, name, child in swaps:
        setattr(parent, name, NativeRMSNorm(child, op))
    return len(swaps)


class NativeDecoderLayer(network.DecoderLayer):
    """A network.DecoderLayer whose decode steps run as one call (`native`: kernels/decoder_layer.cpp),
    set by `use_decoder_layers` on the model's own layers (their modules and names stay as they were)."""

    native: Any = None

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None):
        rows, tokens, _ = hidden_states.shape
        if tokens == 1 and rows <= MAX_ROWS and hidden_states.dtype == torch.bfloat16 and cache is not None:
            reserve = getattr(cache.layers[self.self_attn.layer_idx], "reserve", None)  # kvcache.GrowingLayer's
            room = reserve(1) if reserve is not None else None
            if room is not None:
                cos, sin = position_embeddings
                return self.native.decode(hidden_states, cos, sin, *room, attention_mask)
        return super().forward(hidden_states, position_embeddings, attention_mask, cache)


def use_decoder_layers(model: torch.nn.Module, kernels: native.Kernels) -> int:
    """Each text decoder layer whose norms and decode weights the layer op takes runs its decode steps
    through it (`kernels.decoder_layer()`); returns how many. Called once the weights have their final
    formats and the norms are native (`use_for`)."""
    classes = kernels.decoder_layer()
    if classes is None:
        return 0
    count = 0
    for layer in model.model.language_model.layers:
        op = _layer_op(layer, *classes)
        if op is not None:
            layer.__class__ = NativeDecoderLayer  # the same module, its forward now tries the op first
            layer.native = op
            count += 1
    return count


def _layer_op(layer: torch.nn.Module, product_class, make_layer) -> Any:
    """The layer op for one decoder layer, or None where its parts are not what the op computes."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    if type(layer) is not network.DecoderLayer or mlp.config.hidden_act != "silu":
        return None
    if not all(isinstance(norm, NativeRMSNorm) and norm.weight.dtype == torch.bfloat16 for norm in norms):
        return None
    if len({norm.variance_epsilon for norm in norms}) != 1:
        return None
    for members in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        group = getattr(members[0], "group", None)
        if group is None or [getattr(m, "group", None) for m in members] != [group] * len(members):
            return None
        if [(m.index, m.out_features) for m in members] != list(enumerate(group.sizes)):
            return None
    products = [_product(linear, product_class) for linear in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj)]
    if any(product is None for product in products):
        return None
    config = attn.config
    return make_layer(
        *(norm.weight for norm in norms),
        norms[0].variance_epsilon,
        *products,
        config.num_attention_heads,
        config.num_key_value_heads,
        attn.head_dim,
        mlp.intermediate_size,
        attn.scaling,
    )


def _product(linear: torch.nn.Module, product_class) -> Any:
    """The layer op's Product for a PackedLinear's decode weight (its group's, fused), or None where the
    op does not take its format."""
    if not isinstance(linear, PackedLinear):
        return None
    weight, exact = linear.stored, {}
    if isinstance(weight, ExactChannels):
        weight, exact = weight.inner, {name: getattr(weight, name) for name in EXACT_PARTS}
    if isinstance(weight, NativeBf16Weight) and weight.native_rows >= MAX_ROWS:
        kind, tensors, outputs = BF16, weight.parts, sum(part.shape[0] for part in weight.parts)
    elif isinstance(weight, Int8Weight) and weight.tiles is not None:
        kind, tensors, outputs = Q8, [weight.tiles], weight.shape[0]
    elif isinstance(weight, Int4Weight) and weight.tiled:
        kind, tensors, outputs = INT4, [weight.packed], weight.shape[0]
    else:
        return None
    return product_class(kind, list(tensors), weight.bias, outputs, *(exact.get(name) for name in EXACT_PARTS))
