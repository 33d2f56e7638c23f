"""The model's forward passes for the scheduler: a prefill of a group of new sequences (with their
images' vision features, from the vision cache where it holds them) and a decode step of the batch."""

from __future__ import annotations

import time
from typing import Any

import torch

from vlserve.runtime.batch import BatchState
from vlserve.runtime.caches import LRUCache
from vlserve.runtime.kvcache import new_cache
from vlserve.runtime.metrics import Metrics
from vlserve.runtime.requests import Sequence
from vlserve.runtime.sampling import SamplingParams, next_tokens

WARMUP_KEY = "warmup"  # the warm-up's image: never cached, never counted


class ModelRunner:
    def __init__(self, model, dtype: str, pad_id: int, vision_cache: LRUCache, metrics: Metrics):
        self.model, self.dtype, self.pad_id = model, dtype, pad_id
        self.vision_cache, self.metrics = vision_cache, metrics

    def prefill(self, group: list[Sequence]) -> tuple[BatchState, torch.Tensor]:
        """The group's prompts, left-padded to one length, in one pass: their batch and first tokens."""
        model = self.model
        length = max(s.prompt.tokens for s in group)
        rows = len(group)
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, length), dtype=torch.long)
        token_types = torch.zeros((rows, length), dtype=torch.long)
        for row, seq in enumerate(group):
            n = seq.prompt.tokens
            input_ids[row, length - n :] = seq.prompt.input_ids
            mask[row, length - n :] = 1
            token_types[row, length - n :] = seq.prompt.mm_token_type_ids
        grids = [s.prompt.image_grid_thw for s in group if s.prompt.image_grid_thw is not None]
        image_grid_thw = torch.cat(grids) if grids else None
        encoder_outputs = self.vision_features(group) if grids else None
        vision_positions, deltas = model.model.get_rope_index(
            input_ids, token_types, image_grid_thw=image_grid_thw, attention_mask=mask
        )
        text_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        started = time.monotonic()
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=torch.cat([text_positions[None], vision_positions]),
            cache=new_cache(model.config.text_config.num_hidden_layers),
            mm_encoder_outputs=encoder_outputs,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=token_types,
            use_cache=True,
            logits_to_keep=1,
        )
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        tokens = next_tokens(out.logits[:, -1, :].float(), [s.params for s in group])
        batch = BatchState(
            cache=out.cache,
            attention_mask=mask,
            text_positions=mask.sum(dim=1),
            rope_deltas=deltas.view(-1).to(torch.long),
            next_tokens=tokens,
        )
        return batch, tokens

    def decode(self, batch: BatchState, params: list[SamplingParams]) -> torch.Tensor:
        """One token for every row of the batch, which advances by it."""
        self.metrics.decode_batch.observe(batch.size)
        inputs = batch.step_inputs()
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        batch.cache = out.cache
        tokens = next_tokens(out.logits[:, -1, :].float(), params)
        batch.advance(inputs["attention_mask"], tokens)
        return tokens

    def vision_features(self, group: list[Sequence]) -> dict[str, Any]:
        """Per-image vision features in prompt order, from the cache or one encoder call for the misses."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (  # noqa: PLC0415
            BaseModelOutputWithDeepstackFeatures,
        )

        ordered = _images_in_order(group)
        features, misses = self._cached_features(ordered)
        for seq in group:  # what each request's usage reports
            seq.images_from_cache = sum(1 for key in seq.prompt.image_keys if key in features)
        if misses:
            features.update(self._encode(misses))
        embeds = tuple(features[key][0] for key, _, _ in ordered)
        layers = len(features[ordered[0][0]][1])
        deepstack = [tuple(features[key][1][layer] for key, _, _ in ordered) for layer in range(layers)]
        return {"image": BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)}

    def _cached_features(self, ordered: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[dict, dict]:
        features: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        misses: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, pixels, grid in ordered:
            if key in features or key in misses:
                continue
            cached = self.vision_cache.get(key) if key != WARMUP_KEY else None
            if key != WARMUP_KEY:
                self.metrics.cache_lookup("vision", cached is not None)
            if cached is not None:
                features[key] = cached
            else:
                misses[key] = (pixels, grid)
        return features, misses

    def _encode(self, misses: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """One vision-encoder call for every image the cache missed; their features go into the cache."""
        started = time.monotonic()
        out = self.model.model.get_image_features(
            torch.cat([p for p, _ in misses.values()]), torch.stack([g for _, g in misses.values()])
        )
        self.metrics.image_encode_seconds.observe(time.monotonic() - started)
        text_dtype = getattr(torch, self.dtype)  # a float32 vision tower's output is kept at the text's width
        features = {}
        for index, key in enumerate(misses):
            entry = (
                out.pooler_output[index].to(text_dtype),
                [layer[index].to(text_dtype) for layer in out.deepstack_features],
            )
            features[key] = entry
            if key != WARMUP_KEY:
                self.vision_cache.put(key, entry)
        return features


def _images_in_order(group: list[Sequence]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, pixels, grid row) of every image of the group, in prompt order."""
    ordered = []
    for seq in group:
        prompt = seq.prompt
        if prompt.image_grid_thw is None:
            continue
        offset = 0
        for key, grid in zip(prompt.image_keys, prompt.image_grid_thw, strict=True):
            patches = int(grid.prod())
            ordered.append((key, prompt.pixel_values[offset : offset + patches], grid))
            offset += patches
    return ordered


def feature_bytes(entry) -> int:
    """What one image's vision features hold: the vision cache's cost."""
    if entry is None:
        return 0
    embeds, deepstack = entry
    return sum(t.numel() * t.element_size() for t in [embeds, *deepstack])
