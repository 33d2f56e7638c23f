"""The growing key/value cache holds exactly what concatenating every step's keys and values holds."""

from __future__ import annotations

import torch

from vlserve.runtime import kvcache
from vlserve.runtime.batch import BatchState


def states(rows, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, tokens, 4, generator=generator), torch.randn(rows, 2, tokens, 4, generator=generator)


def test_appends_across_chunk_boundaries_match_concatenation():
    growing = kvcache.GrowingLayer()
    steps = [37] + [1] * (3 * kvcache.CHUNK) + [5]
    buffers, all_keys, all_values = set(), [], []
    for seed, tokens in enumerate(steps):
        keys, values = states(3, tokens, seed)
        got = growing.update(keys, values)
        all_keys.append(keys)
        all_values.append(values)
        assert torch.equal(got[0], torch.cat(all_keys, dim=2)) and torch.equal(got[1], torch.cat(all_values, dim=2))
        assert growing.get_seq_length() == sum(steps[: seed + 1])
        buffers.add(growing._key_buffer.data_ptr())
    # One buffer per CHUNK tokens, not one per step: that is the whole point.
    assert len(buffers) <= 1 + sum(steps) // kvcache.CHUNK


def test_rows_leave_and_join_through_the_batch_state():
    layers = 3
    first = kvcache.new_cache(layers, [states(2, 10, seed) for seed in range(layers)])
    second = kvcache.new_cache(layers, [states(1, 6, seed + 10) for seed in range(layers)])

    def batch(cache, rows, length):
        return BatchState(
            cache=cache,
            attention_mask=torch.ones(rows, length, dtype=torch.long),
            text_positions=torch.full((rows,), length),
            rope_deltas=torch.zeros(rows, dtype=torch.long),
            next_tokens=torch.zeros(rows, dtype=torch.long),
        )

    merged = batch(first, 2, 10)
    merged.merge(batch(second, 1, 6))
    merged.select([0, 2])
    for index, layer in enumerate(merged.cache.layers):
        assert isinstance(layer, kvcache.GrowingLayer)
        keys, _ = states(2, 10, index)
        other, _ = states(1, 6, index + 10)
        assert torch.equal(layer.keys[0], keys[0])
        assert torch.equal(layer.keys[1, :, 4:], other[0]) and not layer.keys[1, :, :4].any()
        # A decode step after the rebuild appends in place.
        step_keys, step_values = states(2, 1, 99)
        layer.update(step_keys, step_values)
        assert layer.get_seq_length() == 11 and torch.equal(layer.values[:, :, 10:], step_values)
