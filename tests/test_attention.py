"""The decode step's attention (vlserve/model/attention.py): sdpa's answer within bfloat16's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlserve.kernels import native, reference
from vlserve.model import attention
from vlserve.model.loader import load_model
from vlserve.model.network import text_positions
from vlserve.runtime.kvcache import new_cache
from vlserve.settings import LimitSettings, ModelSettings


def _inputs(batch, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, 16, 1, 128, generator=generator).to(torch.bfloat16)
    # Wide keys make large scores, where rounding each score to bfloat16 would show.
    key = (4 * torch.randn(batch, 8, length, 128, generator=generator)).to(torch.bfloat16)
    value = torch.randn(batch, 8, length, 128, generator=generator).to(torch.bfloat16)
    return query, key, value


def _reference(query, key, value, mask):
    """float32 sdpa of the same bfloat16 inputs, as (B, 1, H, D)."""
    out = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=0.088, enable_gqa=True
    )
    return out.transpose(1, 2)


def _max_error(out, expected):
    return (out.float() - expected).abs().max().item()


@pytest.mark.parametrize("batch,length", [(1, 7), (3, 300)])
def test_one_query_attention_is_as_close_to_float32_as_sdpa_in_bfloat16(batch, length):
    query, key, value = _inputs(batch, length)
    expected = _reference(query, key, value, None)
    ours = reference.one_query_attention(query, key, value, None, scaling=0.088)
    sdpa = F.scaled_dot_product_attention(query, key, value, scale=0.088, enable_gqa=True).transpose(1, 2)
    assert ours.shape == (batch, 1, 16, 128) and ours.dtype == torch.bfloat16
    # Both round probabilities and outputs to bfloat16 (~0.4% of a value near 1); scores rounded to
    # bfloat16 as well would add errors of several times that with these wide keys.
    assert _max_error(ours, expected) <= max(2 * _max_error(sdpa, expected), 0.02)


@pytest.mark.parametrize("boolean", [True, False])
def test_padding_masks_are_honoured(boolean):
    query, key, value = _inputs(2, 40, seed=1)
    attends = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    attends[1, ..., :25] = False  # the second sequence is left-padded by 25 positions
    additive = torch.zeros(attends.shape, dtype=query.dtype).masked_fill_(~attends, float("-inf"))
    mask = attends if boolean else additive
    ours = reference.one_query_attention(query, key, value, mask, scaling=0.088)
    assert _max_error(ours, _reference(query, key, value, attends)) < 0.02
    # The padded positions carry no weight: changing them changes nothing.
    key[1, :, :25], value[1, :, :25] = 100.0, -100.0
    again = reference.one_query_attention(query, key, value, mask, scaling=0.088)
    assert torch.equal(again, ours)


def test_the_batch_is_widened_in_chunks_with_the_same_result(monkeypatch):
    query, key, value = _inputs(3, 64, seed=2)
    whole = reference.one_query_attention(query, key, value, None, scaling=None)
    monkeypatch.setattr(reference, "WIDENED_KEYS_BYTES", 1)  # one sequence at a time
    assert torch.equal(reference.one_query_attention(query, key, value, None, scaling=None), whole)


def test_float32_and_prompts_keep_sdpa(monkeypatch):
    monkeypatch.setattr(native, "_outcome", None)  # the Python path, whatever this process loaded
    calls = []
    monkeypatch.setattr(attention, "one_query_attention", lambda *args, **kwargs: calls.append(args))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    query, key, value = _inputs(1, 12)
    attention.attention(module, query.float(), key.float(), value.float(), None, scaling=0.088)
    prompt = query.expand(1, 16, 5, 128)
    attention.attention(module, prompt, key, value, None, scaling=0.088, is_causal=False)
    assert calls == []
    attention.attention(module, query, key, value, None, scaling=0.088)
    assert len(calls) == 1


def test_a_loaded_model_decodes_through_it_as_it_would_through_sdpa(tiny_model, monkeypatch):
    # The Python path: where vlserve's kernels load, decode steps attend through their op (test_native).
    monkeypatch.setattr(native, "_outcome", None)
    loaded = load_model(
        ModelSettings(model=tiny_model, dtype="bfloat16", prefill_dtype="bfloat16", native_kernels="off"),
        LimitSettings(max_batch_size=2),
        lambda _: None,
    )
    config = loaded.model.config.text_config
    layers = [layer.self_attn for layer in loaded.model.model.language_model.layers]
    assert all(module.attend.func is attention.attention for module in layers)
    # Two left-padded sequences, then one decode step each way.
    ids = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    calls = []
    original = attention.one_query_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    def plain_sdpa(module, query, key, value, mask, *, scaling=None, is_causal=None):
        return attention.sdpa(module, query, key, value, mask, scaling=scaling, is_causal=is_causal), None

    monkeypatch.setattr(attention, "one_query_attention", counted)
    steps = {}
    ours_attend = layers[0].attend
    for implementation, attend in (("vlserve", ours_attend), ("sdpa", plain_sdpa)):
        for module in layers:
            monkeypatch.setattr(module, "attend", attend)
        cache = new_cache(config.num_hidden_layers)
        with torch.inference_mode():
            loaded.model(ids, mask, text_positions(2, 0, 8), cache, logits_to_keep=1)
            step = loaded.model(
                torch.tensor([[31], [32]]),
                torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1),
                text_positions(2, 8, 1),
                cache,
                logits_to_keep=1,
            )
        steps[implementation] = step.logits.float()
    assert len(calls) == config.num_hidden_layers  # the decode step of the first pass, every layer
    ours, sdpa = steps["vlserve"], steps["sdpa"]
    assert torch.allclose(ours, sdpa, atol=0.05 * sdpa.abs().max().item())
    assert torch.equal(ours.argmax(-1), sdpa.argmax(-1))
