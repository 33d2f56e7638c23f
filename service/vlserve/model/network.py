"""Qwen3-VL, the network vlserve serves: images and text in, logits out.

vlserve's own copy of transformers' Qwen3VLForConditionalGeneration (5.24): the same modules, the
same parameter names (a checkpoint's tensors load by name, model/checkpoint.py) and the same
operations in the same order, so its logits equal transformers' bit for bit on the same weights
(tests/test_network.py). Cut to what a server runs: inference only, images only (no video), the
attention of model/attention.py, positions always given by the caller (runtime/runner.py).

Why a copy: a worker that imported transformers' model classes spent 1.35 s of a 3 s start on the
import alone (its lazy import tables, torch.distributed.tensor, torch._dynamo, torch.export, all
pulled in by code a server never runs), which kept its start at 1.6-2.2x llama-server's. Owning the
network also ends the patching of transformers' module-level functions at load: the attention and
the rotary embedding are attributes of this code's own modules, set per model (model/decoderops.py).
transformers stays what the tests hold this network to and what writes test checkpoints.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.kernels import reference
from vlserve.model import attention
from vlserve.model.config import GenerationConfig, ModelConfig, TextConfig, VisionConfig

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError("activation %r is not one vlserve runs (%s)" % (name, ", ".join(ACTIVATIONS)))
    return ACTIVATIONS[name]


@dataclass
class VisionFeatures:
    """Per image: its merged features (`pooler_output`) and, per deepstack layer, its features there."""

    pooler_output: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]]


@dataclass
class ModelOutput:
    logits: torch.Tensor
    cache: Any


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """The text attention's rotary embedding: (batch, heads, tokens, dim) queries and keys."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# ---------------------------------------------------------------------------------------------------
# The vision tower


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionPatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.in_channels, self.embed_dim = config.in_channels, config.hidden_size
        self.patch_size, self.temporal_patch_size = config.patch_size, config.temporal_patch_size
        kernel = [config.temporal_patch_size, config.patch_size, config.patch_size]
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(pixels.to(dtype=self.proj.weight.dtype)).view(-1, self.embed_dim)


# The network is built on the meta device (vlserve/model/checkpoint.py). A few operations run there
# through torch's Python decompositions, and the first one imports torch._dynamo: 1.1 s of a worker's
# 3 s start (2-vCPU Zen 4). So nothing here initialises weights the checkpoint replaces, and the tables
# a module computes are computed on the CPU, where they stay.


def uninitialised_embedding(count: int, size: int, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table left as allocated (nn.Embedding's own initialisation is a normal_)."""
    return nn.Embedding(count, size, padding_idx, _weight=torch.empty(count, size))


def rope_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """Rotary embedding's 1 / theta^(2i / dim), float32, on the CPU whatever the default device."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


class VisionRotaryEmbedding(nn.Module):
    """Axial 2-D rope: the same frequencies for rows and columns, over the whole head."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config.rope_theta, config.hidden_size // config.num_heads // 2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        return self._layout(freqs.cos()), self._layout(freqs.sin())

    @staticmethod
    def _layout(freq: torch.Tensor) -> torch.Tensor:
        rows_columns = torch.cat([freq[:, 0], freq[:, 1]], dim=-1)
        return torch.cat([rows_columns, rows_columns], dim=-1)


class VisionPatchMerger(nn.Module):
    def __init__(self, config: VisionConfig, use_postshuffle_norm: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size**2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if use_postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden_size) if self.use_postshuffle_norm else x).view(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def apply_vision_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The vision attention's rotary embedding: (tokens, heads, dim) queries and keys, (tokens, dim)
    tables, in float32, rounded back once."""
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    return q.to(dtype), k.to(dtype)


class VisionAttention(nn.Module):
    is_causal = False
    num_key_value_groups = 1

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.scaling = self.head_dim**-0.5
        self.attend: Callable = attention.attention
        self.rotary: Callable = apply_vision_rotary

    def forward(self, hidden_states, lengths: list[int], position_embeddings) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = self.rotary(q, k, *position_embeddings)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        # Each image attends to itself only.
        splits = [torch.split(t, lengths, dim=2) for t in (q, k, v)]
        outputs = [
            self.attend(self, *qkv, None, scaling=self.scaling, is_causal=False)[0] for qkv in zip(*splits, strict=True)
        ]
        return self.proj(torch.cat(outputs, dim=1).reshape(tokens, -1).contiguous())


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, hidden_states, lengths: list[int], position_embeddings) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), lengths, position_embeddings)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(config)
        self.pos_embed = uninitialised_embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.rotary_pos_emb = VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = VisionPatchMerger(config)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            [VisionPatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_visual_indexes]
        )

    @property
    def dtype(self) -> torch.dtype:
        return first_float_dtype(self)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged features of every patch of every image, and the deepstack layers' features."""
        indices, weights = position_table_taps(grid_thw, self.num_grid_per_side, self.spatial_merge_size)
        hidden_states = self.patch_embed(pixels)
        position_embeds = (self.pos_embed(indices) * weights[:, :, None]).sum(1)
        hidden_states = hidden_states + position_embeds.to(hidden_states.dtype)
        rotary = self.rotary_pos_emb(block_positions(grid_thw, self.spatial_merge_size))
        lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, lengths, rotary)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(hidden_states))
        return self.merger(hidden_states), deepstack


def block_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch, [patches, 2], in the order the merger groups them: merge x merge
    blocks, block by block."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        columns = columns.reshape(shape).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, columns], dim=-1).repeat(t, 1))
    return torch.cat(positions, dim=0)


def position_table_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned side x side position table resampled (bilinear, corners aligned) to each image's grid:
    per patch, in block order, four table indices and their weights."""
    counts = grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]
    heights = torch.repeat_interleave(grid_thw[:, 1], counts)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    starts = torch.repeat_interleave(F.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
    within = (torch.arange(counts.sum()) - starts) % (heights * widths)
    blocks_w = widths // merge
    row = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    column = ((within // (merge * merge)) % blocks_w) * merge + within % merge
    row_taps, row_weights = _axis_taps(row, heights, side)
    column_taps, column_weights = _axis_taps(column, widths, side)
    indices = (row_taps[:, :, None] * side + column_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * column_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    source = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(source)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


# ---------------------------------------------------------------------------------------------------
# The language model


class TextRotaryEmbedding(nn.Module):
    """Interleaved M-RoPE: each frequency turns by the temporal, row or column position by its index."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.rope_theta, config.head_dim), persistent=False)
        self.mrope_section = list(config.mrope_section)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids`: [3, batch, tokens] (temporal, row, column)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        return self._interleave(cos).to(x.dtype), self._interleave(sin).to(x.dtype)

    def _interleave(self, freq: torch.Tensor) -> torch.Tensor:
        result = freq[0]
        for dim, offset in enumerate((1, 2), start=1):
            section = slice(offset, self.mrope_section[dim] * 3, 3)
            result[..., section] = freq[dim, ..., section]
        return torch.cat((result, result), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return "%s, eps=%s" % (tuple(self.weight.shape), self.variance_epsilon)


class TextAttention(nn.Module):
    is_causal = True

    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias, hidden, heads, kv_heads = (
            config.attention_bias,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attend: Callable = attention.attention
        self.rotary: Callable = apply_rotary

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = self.rotary(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, _ = self.attend(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous())


class TextMLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TextAttention(config, layer_idx)
        self.mlp = TextMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class TextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = uninitialised_embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DecoderLayer(config, index) for index in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = TextRotaryEmbedding(config)

    def forward(self, embeds, attention_mask, position_ids, cache, *, visual_mask=None, deepstack=None) -> torch.Tensor:
        """`position_ids`: [4, batch, tokens] (the text position, then M-RoPE's three); `attention_mask`:
        [batch, cached + new tokens], 1 for real tokens, 0 for padding."""
        past = cache.get_seq_length() if cache is not None else 0
        mask = causal_mask(attention_mask, embeds.shape[1], past)
        position_embeddings = self.rotary_emb(embeds, position_ids[1:])
        hidden_states = embeds
        for index, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=mask, cache=cache)
            if deepstack is not None and index < len(deepstack):
                hidden_states = hidden_states.clone()
                hidden_states[visual_mask, :] = hidden_states[visual_mask, :] + deepstack[index].to(hidden_states.dtype)
        return self.norm(hidden_states)


def causal_mask(padding: torch.Tensor | None, queries: int, past: int) -> torch.Tensor | None:
    """The attention's mask as transformers' sdpa masks make it: None where no token is padding and the
    queries are one token or the whole sequence (the attention then masks causally itself); else
    [batch, 1, queries, keys] booleans, True where a query may see a key (at or before its own
    position, and not padding)."""
    keys = past + queries
    if padding is not None:
        padding = padding[:, :keys].bool()
    if queries in {1, keys} and (padding is None or bool(padding.all())):
        return None
    if past == 0 and (padding is None or (bool(padding[:, :queries].all()) and not bool(padding[:, queries:].any()))):
        return None
    allowed = torch.arange(keys)[None, :] <= (torch.arange(queries) + past)[:, None]
    mask = allowed[None, None].expand(padding.shape[0] if padding is not None else 1, 1, queries, keys)
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    return mask


# ---------------------------------------------------------------------------------------------------
# The whole


class Qwen3VLModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionModel(config.vision_config)
        self.language_model = TextModel(config.text_config)

    def get_image_features(self, pixels: torch.Tensor, image_grid_thw: torch.Tensor) -> VisionFeatures:
        """The vision tower over every image's patches, its outputs split image by image."""
        merged, deepstack = self.visual(pixels.type(self.visual.dtype), image_grid_thw)
        sizes = (image_grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        return VisionFeatures(torch.split(merged, sizes), [torch.split(layer, sizes) for layer in deepstack])

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE positions, [3, batch, tokens], and how far they run ahead of the token count, [batch, 1]:
        text tokens advance all three by one; an image's tokens take (start, start + row, start +
        column) of its merged grid, and the text after it starts past its larger side."""
        merge = self.config.vision_config.spatial_merge_size
        positions = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype)
        grids = iter(image_grid_thw) if image_grid_thw is not None else None
        deltas = []
        for row, types in enumerate(mm_token_type_ids):
            pieces, current = [], 0
            for kind, run in itertools.groupby(enumerate(types.tolist()), lambda item: item[1]):
                members = list(run)
                length = members[-1][0] + 1 - members[0][0]
                if kind == 0:
                    pieces.append(torch.arange(length).view(1, -1).expand(3, -1) + current)
                    current += length
                else:
                    grid = next(grids)
                    t, h, w = grid[0].item(), grid[1].item() // merge, grid[2].item() // merge
                    temporal, rows, columns = torch.meshgrid(
                        torch.arange(t), torch.arange(h) + current, torch.arange(w) + current, indexing="ij"
                    )
                    image = torch.stack([temporal, rows, columns], dim=0).reshape(3, -1)
                    image[0] += current
                    pieces.append(image)
                    current += max(grid[1], grid[2]) // merge
            row_positions = torch.cat(pieces, dim=1).reshape(3, -1)
            positions[:, row] = row_positions
            deltas.append(row_positions.max() + 1 - len(input_ids[row]))
        return positions, torch.tensor(deltas).unsqueeze(1)

    def forward(self, input_ids, attention_mask, position_ids, cache, vision: VisionFeatures | None = None):
        embeds = self.language_model.embed_tokens(input_ids)
        visual_mask, deepstack = None, None
        if vision is not None:
            features = torch.cat(vision.pooler_output, dim=0).to(embeds.dtype)
            visual_mask = input_ids == self.config.image_token_id
            if int(visual_mask.sum()) * embeds.shape[-1] != features.numel():
                raise ValueError(
                    "image features and image tokens do not match: %d tokens, %d features"
                    % (int(visual_mask.sum()), features.shape[0])
                )
            embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1), features)
            deepstack = [torch.cat(layer, dim=0) for layer in vision.deepstack_features]
        return self.language_model(
            embeds, attention_mask, position_ids, cache, visual_mask=visual_mask, deepstack=deepstack
        )


class Qwen3VLForConditionalGeneration(nn.Module):
    """The network with its language-model head; `generation_config` as the checkpoint gives it."""

    def __init__(self, config: ModelConfig, generation_config: GenerationConfig | None = None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config or GenerationConfig()
        self.model = Qwen3VLModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return first_float_dtype(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        vision: VisionFeatures | None = None,
        *,
        logits_to_keep: int = 0,
    ) -> ModelOutput:
        """Logits of the last `logits_to_keep` tokens (0: all); `cache` (runtime/kvcache.py) grows by
        the tokens fed. No `position_ids`: text continuing what the cache holds (`text_positions`)."""
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = text_positions(input_ids.shape[0], past, input_ids.shape[1])
        hidden_states = self.model(input_ids, attention_mask, position_ids, cache, vision)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        return ModelOutput(logits=self.lm_head(hidden_states), cache=cache)


def text_positions(rows: int, start: int, count: int) -> torch.Tensor:
    """[4, rows, count]: positions start .. start + count - 1 of text with no image before it (the
    text position and M-RoPE's three are then one number)."""
    return torch.arange(start, start + count).view(1, 1, -1).expand(4, rows, -1)


def prompt_positions(model: Qwen3VLForConditionalGeneration, inputs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A processed prompt's positions, [4, 1, tokens], and how far M-RoPE's run ahead of the text's
    after it (what each later token's three positions add to its text position)."""
    ids = inputs["input_ids"]
    vision, delta = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs.get("image_grid_thw"))
    return torch.cat([torch.arange(ids.shape[1]).expand(1, *ids.shape), vision]), int(delta.view(-1)[0])


def prompt_pass(model: Qwen3VLForConditionalGeneration, inputs: dict[str, Any], cache=None, logits_to_keep: int = 0):
    """One processed prompt (the processor's output, one row) through the model: its image features
    and positions computed here. What tools and checks run; the engine batches its own (runtime/runner.py)."""
    positions, _ = prompt_positions(model, inputs)
    pixels = inputs.get("pixel_values")
    vision = model.model.get_image_features(pixels, inputs["image_grid_thw"]) if pixels is not None else None
    return model(
        inputs["input_ids"], inputs.get("attention_mask"), positions, cache, vision, logits_to_keep=logits_to_keep
    )


def first_float_dtype(module: nn.Module) -> torch.dtype:
    """A module's dtype as transformers reads it: its first floating-point parameter's."""
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()
