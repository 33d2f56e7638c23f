"""The model's forward passes for the scheduler: a prefill of a group of new sequences (each after
the prefix whose keys and values the prefix cache holds, with the vision features of the images
after it, from the vision cache where it holds them) and a decode step of the batch; and what a
finished sequence leaves in the prefix cache."""

from __future__ import annotations

import logging
import time

import torch

from vlserve.model.network import VisionFeatures
from vlserve.runtime.batch import BatchState
from vlserve.runtime.caches import LRUCache
from vlserve.runtime.kvcache import new_cache
from vlserve.runtime.metrics import Metrics
from vlserve.runtime.prefixcache import Entry, Hit, PrefixCache, image_spans
from vlserve.runtime.requests import Prompt, Sequence
from vlserve.runtime.sampling import SamplingParams, next_tokens

log = logging.getLogger(__name__)
WARMUP_KEY = "warmup"  # the warm-up's image: never cached, never counted


class ModelRunner:
    def __init__(
        self,
        model,
        dtype: str,
        pad_id: int,
        vision_cache: LRUCache,
        metrics: Metrics,
        *,
        prefix_cache: PrefixCache | None = None,
    ):
        self.model, self.dtype, self.pad_id = model, dtype, pad_id
        self.vision_cache, self.metrics = vision_cache, metrics
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)

    def prefill(self, group: list[Sequence]) -> tuple[BatchState, torch.Tensor]:
        """The group's prompts in one pass, each after the prefix the prefix cache holds of it: their
        batch and first tokens. Columns: the stored prefixes left-padded to one length, then the rest
        of each prompt left-padded to one length (the mask marks the padding between)."""
        hits = [self._lookup(seq) for seq in group]
        prefix = max(seq.cached_tokens for seq in group)
        length = max(seq.prompt.tokens - seq.cached_tokens for seq in group)
        rows = len(group)
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        token_types = torch.zeros((rows, length), dtype=torch.long)
        mask = torch.zeros((rows, prefix + length), dtype=torch.long)
        positions = torch.zeros((4, rows, length), dtype=torch.long)
        deltas = torch.zeros(rows, dtype=torch.long)
        for row, seq in enumerate(group):
            cached, new = seq.cached_tokens, seq.prompt.tokens - seq.cached_tokens
            input_ids[row, length - new :] = seq.prompt.input_ids[cached:]
            token_types[row, length - new :] = seq.prompt.mm_token_type_ids[cached:]
            mask[row, prefix - cached : prefix] = 1
            mask[row, prefix + length - new :] = 1
            row_positions, deltas[row] = self._positions(seq.prompt)
            positions[:, row, length - new :] = row_positions[:, cached:]
        images = _images_in_order(group)
        encoder_outputs, encoded = self.vision_features(images) if images else (None, set())
        for seq in group:  # what each request's usage reports: images not encoded for it
            seq.images_from_cache = sum(1 for key in seq.prompt.image_keys if key not in encoded)
        layers = self.model.config.text_config.num_hidden_layers
        cache = new_cache(layers, _stored_prefixes(hits, prefix) if prefix else None)
        started = time.monotonic()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            vision=encoder_outputs,
            logits_to_keep=1,
        )
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        tokens = next_tokens(out.logits[:, -1, :], [s.params for s in group])
        batch = BatchState(
            cache=out.cache,
            attention_mask=mask,
            text_positions=mask.sum(dim=1),
            rope_deltas=deltas,
            next_tokens=tokens,
        )
        return batch, tokens

    def _lookup(self, seq: Sequence) -> Hit | None:
        """The stored prefix the sequence starts with, if any (its length goes into `seq.cached_tokens`)."""
        hit = None
        if self.prefix_cache.enabled and WARMUP_KEY not in seq.prompt.image_keys:
            hit = self.prefix_cache.lookup(seq.prompt)
            self.metrics.cache_lookup("prefix", hit is not None)
        seq.cached_tokens = hit.tokens if hit is not None else 0
        return hit

    def _positions(self, prompt: Prompt) -> tuple[torch.Tensor, int]:
        """Every token's position, [4, tokens] (text, then Qwen3-VL's temporal, height, width), and how
        far the 3-D positions run ahead of the text ones after the last image: the prompt alone, so a
        stored prefix and a full prefill give each token the same position."""
        vision, delta = self.model.model.get_rope_index(
            prompt.input_ids[None], prompt.mm_token_type_ids[None], image_grid_thw=prompt.image_grid_thw
        )
        text = torch.arange(prompt.tokens, dtype=torch.long)[None]
        return torch.cat([text, vision[:, 0]]), int(delta.view(-1)[0])

    def remember(self, seq: Sequence, batch: BatchState, row: int, live: int) -> None:
        """A finished sequence's keys and values (its prompt and the answer tokens fed back) into the
        prefix cache, as far as `live` bytes of running sequences leave room."""
        cache = self.prefix_cache
        if not cache.enabled or WARMUP_KEY in seq.prompt.image_keys:
            return
        tokens = torch.cat([seq.prompt.input_ids, torch.tensor(seq.generated[:-1], dtype=torch.long)])
        columns = batch.attention_mask[row].nonzero().view(-1)
        if columns.numel() != tokens.numel():  # never expected; an optional cache must not fail the batch
            log.warning("not stored: row %d holds %d tokens, its sequence fed %d", row, columns.numel(), tokens.numel())
            return
        layers = batch.cache.layers
        first = layers[0].keys
        shape = (len(layers), 2, first.shape[1], tokens.numel(), first.shape[3])
        if tokens.numel() * first.shape[1] * first.shape[3] * 2 * len(layers) * first.element_size() > cache.room(live):
            return
        kv = first.new_empty(shape)
        for index, layer in enumerate(layers):
            torch.index_select(layer.keys[row], 1, columns, out=kv[index, 0])
            torch.index_select(layer.values[row], 1, columns, out=kv[index, 1])
        cache.store(Entry(tokens, image_spans(seq.prompt), kv), live)

    def make_room(self, live: int) -> None:
        """Stored prefixes give way to `live` bytes of running sequences."""
        self.prefix_cache.fit(live)

    def decode(self, batch: BatchState, params: list[SamplingParams]) -> torch.Tensor:
        """One token for every row of the batch, which advances by it."""
        self.metrics.decode_batch.observe(batch.size)
        inputs = batch.step_inputs()
        out = self.model(**inputs, logits_to_keep=1)
        batch.cache = out.cache
        tokens = next_tokens(out.logits[:, -1, :], params)
        batch.advance(inputs["attention_mask"], tokens)
        return tokens

    def vision_features(self, ordered: list[tuple[str, torch.Tensor, torch.Tensor]]) -> tuple[VisionFeatures, set]:
        """Per-image vision features in prompt order (`ordered`: the group's images after their stored
        prefixes), from the cache or one encoder call for the misses; and the keys it encoded."""
        features, misses = self._cached_features(ordered)
        if misses:
            features.update(self._encode(misses))
        embeds = tuple(features[key][0] for key, _, _ in ordered)
        layers = len(features[ordered[0][0]][1])
        deepstack = [tuple(features[key][1][layer] for key, _, _ in ordered) for layer in range(layers)]
        return VisionFeatures(pooler_output=embeds, deepstack_features=deepstack), set(misses)

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
    """(key, pixels, grid row) of every image of the group after its stored prefix, in prompt order."""
    ordered = []
    for seq in group:
        prompt = seq.prompt
        if prompt.image_grid_thw is None:
            continue
        offset = 0
        for (start, _, key), grid in zip(image_spans(prompt), prompt.image_grid_thw, strict=True):
            patches = int(grid.prod())
            if start >= seq.cached_tokens:
                ordered.append((key, prompt.pixel_values[offset : offset + patches], grid))
            offset += patches
    return ordered


def _stored_prefixes(hits: list[Hit | None], length: int):
    """Per layer, the group's stored keys and values left-padded to `length` tokens (zeros where a row
    has fewer), [rows, kv_heads, length, head_dim] each: one layer at a time, so one layer's copy is
    the only temporary."""
    sample = next(hit for hit in hits if hit is not None).entry.kv
    _, _, kv_heads, _, head_dim = sample.shape
    for layer in range(sample.shape[0]):
        keys = sample.new_zeros((len(hits), kv_heads, length, head_dim))
        values = torch.zeros_like(keys)
        for row, hit in enumerate(hits):
            if hit is not None:
                stored = hit.entry.kv[layer, :, :, : hit.tokens]
                keys[row, :, length - hit.tokens :] = stored[0]
                values[row, :, length - hit.tokens :] = stored[1]
        yield keys, values


def feature_bytes(entry) -> int:
    """What one image's vision features hold: the vision cache's cost."""
    if entry is None:
        return 0
    embeds, deepstack = entry
    return sum(t.numel() * t.element_size() for t in [embeds, *deepstack])
