"""The decoder layer op (kernels/decoder_layer.cpp, vlserve.model.decoderops): where the AVX-512 VNNI tier
loads, a decode step's layers run as one call each, and what they compute is the network's own layer
(model/network.py) on vlserve's ops bit for bit (logits and the cache's keys and values) at every
level, with the outlier channels a rounded weight keeps exact, for a batch with a left-padded row and
across the cache's growth. What it does not take runs the network's own forward."""

from __future__ import annotations

import pathlib

import pytest
import torch
from test_native import HAS_BF16, TIER, TIER_WHY

from conftest import NATIVE_KERNELS, run_tool
from vlserve.model import decoderops
from vlserve.model.loader import load_model
from vlserve.model.network import text_positions
from vlserve.runtime.kvcache import CHUNK, new_cache
from vlserve.settings import LimitSettings, ModelSettings

needs_avx512 = pytest.mark.skipif(
    TIER != "avx512_vnni", reason="the layer op needs the AVX-512 VNNI tier: %s" % TIER_WHY
)
PROMPT = CHUNK - 4  # the decode steps below grow every layer's buffers once
STEPS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The tiny checkpoint, and one whose residual streams carry outlier channels."""
    made = {}
    for shape, extra in (("plain", []), ("outliers", ["--outlier-channels", "4"])):
        made[shape] = tmp_path_factory.mktemp("models") / shape
        result = run_tool("vlserve", "make-test-model", str(made[shape]), "--size", "tiny", *extra, timeout=300)
        assert result.returncode == 0, result.stderr
    return made


class Counting:
    """A layer op that counts its decode calls."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def decode(self, *args):
        self.calls += 1
        return self.op.decode(*args)


def _load(path: pathlib.Path, level: str, monkeypatch, dtype: str = "bfloat16"):
    from vlserve.kernels import native  # noqa: PLC0415

    monkeypatch.setattr(native, "_outcome", None)
    settings = ModelSettings(model=path, quantize=level, dtype=dtype, native_kernels=NATIVE_KERNELS, warmup=False)
    loaded = load_model(settings, LimitSettings(max_batch_size=4), lambda _: None)
    loaded.settle()
    return loaded


def _decode(model, rows: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A prompt of PROMPT tokens a row (the second row left-padded by 5), then STEPS decode steps: the
    steps' logits and every layer's keys and values."""
    ids = torch.arange(100, 100 + PROMPT)[None].repeat(rows, 1)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, :5] = 0
    cache, logits = new_cache(model.config.text_config.num_hidden_layers), []
    with torch.inference_mode():
        out = model(ids, mask, text_positions(rows, 0, PROMPT), cache, logits_to_keep=1)
        for step in range(STEPS):
            token = out.logits[:, -1:].float().argmax(-1)
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
            out = model(token, mask, text_positions(rows, PROMPT + step, 1), out.cache, logits_to_keep=1)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits), [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@needs_avx512
@pytest.mark.parametrize(
    "level, shape",
    [
        pytest.param("none", "plain", marks=pytest.mark.skipif(not HAS_BF16, reason="needs AVX-512 BF16")),
        ("int8", "plain"),
        ("int8", "outliers"),
        ("int4", "plain"),
        ("int4", "outliers"),
    ],
)
def test_a_decode_step_through_the_layer_op_is_the_networks_layer_bit_for_bit(checkpoints, level, shape, monkeypatch):
    loaded = _load(checkpoints[shape], level, monkeypatch)
    layers = list(loaded.model.model.language_model.layers)
    assert all(isinstance(layer, decoderops.NativeDecoderLayer) for layer in layers)
    weights = [layer.mlp.down_proj.stored for layer in layers]
    assert {type(w).__name__ == "ExactChannels" for w in weights} == {shape == "outliers"}
    counters = []
    for layer in layers:
        layer.native = Counting(layer.native)
        counters.append(layer.native)
    for rows in (1, 3):
        got, got_cache = _decode(loaded.model, rows)
        assert [counter.calls for counter in counters] == [STEPS] * len(layers)  # every step, every layer
        monkeypatch.setattr(decoderops, "MAX_ROWS", 0)  # the network's own forward for every step
        expected, expected_cache = _decode(loaded.model, rows)
        monkeypatch.undo()
        assert [counter.calls for counter in counters] == [STEPS] * len(layers)
        assert torch.equal(got, expected)
        for (keys, values), (expected_keys, expected_values) in zip(got_cache, expected_cache, strict=True):
            assert keys.shape[2] == PROMPT + STEPS and torch.equal(keys, expected_keys)
            assert torch.equal(values, expected_values)
        for counter in counters:
            counter.calls = 0


@needs_avx512
def test_what_the_layer_op_does_not_take_runs_the_networks_forward(checkpoints, monkeypatch):
    """A float32 model keeps the network's own layers (the op takes bfloat16 rows); more rows than MAX_ROWS
    in one step go to their forward too (they would reach the prompt copies)."""
    wide = _load(checkpoints["plain"], "int8", monkeypatch, dtype="float32")
    assert not any(isinstance(m, decoderops.NativeDecoderLayer) for m in wide.model.modules())
    loaded = _load(checkpoints["plain"], "int8", monkeypatch)
    counters = []
    for layer in loaded.model.model.language_model.layers:
        layer.native = Counting(layer.native)
        counters.append(layer.native)
    logits, _ = _decode(loaded.model, decoderops.MAX_ROWS + 1)
    assert logits.isfinite().all() and {counter.calls for counter in counters} == {0}
