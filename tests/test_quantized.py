"""Dynamic int8 products: exact integer arithmetic around per-row scales, close to the float product."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from conftest import run_tool
from vlserve.packing import PackedLinear, packing_supported
from vlserve.quantized import (
    INT8_PREFILL_ROWS,
    Int8Linear,
    Int8Weight,
    PromptInt8Linear,
    quantize_rows,
    quantize_vision_tower,
)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rows_are_quantized_to_within_half_a_step_and_zero_rows_stay_zero():
    torch.manual_seed(0)
    matrix = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 7.0])[:, None]
    values, scales = quantize_rows(matrix)
    assert values.dtype == torch.int8 and values.abs().max() <= 127
    assert values[torch.arange(5) != 3].abs().amax(dim=1).tolist() == [127, 127, 127, 127]  # full range per row
    assert torch.all((values.float() * scales[:, None] - matrix).abs() <= scales[:, None] / 2 + 1e-12)
    assert torch.equal(values[3], torch.zeros(300, dtype=torch.int8))


def test_the_product_is_the_integer_product_rescaled():
    torch.manual_seed(1)
    weight, bias, rows = torch.randn(48, 96), torch.randn(48), torch.randn(20, 96) * 3
    layer = Int8Weight(weight, bias)
    q_rows, row_scales = quantize_rows(rows)
    exact = (q_rows.long() @ layer.values.long().t()).double() * row_scales.double()[:, None] * layer.scales.double()
    assert torch.allclose(layer.matmul(rows).double(), exact + bias.double(), rtol=1e-5, atol=1e-5)
    # And close to the float product: 255 levels per row give well under 2% on Gaussian data.
    assert relative_error(layer.matmul(rows), rows @ weight.t() + bias) < 0.02


def test_int8_linear_keeps_shape_and_dtype():
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    out = Int8Linear(linear)(torch.randn(2, 7, 64).to(torch.bfloat16))
    assert out.shape == (2, 7, 32) and out.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny-bf16"
    assert run_tool("vlserve", "make-test-model", str(directory)).returncode == 0
    return directory


def test_the_vision_tower_in_int8_stays_close_to_float32(tiny_bf16):
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_bf16, dtype=torch.float32).eval()
    grid = torch.tensor([[1, 8, 8]])
    config = model.config.vision_config
    pixels = torch.randn(64, config.in_channels * config.temporal_patch_size * config.patch_size**2)
    with torch.inference_mode():
        reference = model.model.get_image_features(pixels, grid).pooler_output[0]
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.model.visual.modules())
        assert quantize_vision_tower(model.model.visual) == linears > 0
        assert not any(isinstance(m, torch.nn.Linear) for m in model.model.visual.modules())
        assert all(p.dtype == torch.float32 for p in model.model.visual.parameters())
        quantized = model.model.get_image_features(pixels, grid).pooler_output[0]
    assert quantized.shape == reference.shape
    assert 0 < relative_error(quantized, reference) < 0.05


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels")
def test_prompt_sized_products_run_on_the_int8_copy():
    torch.manual_seed(2)
    plain = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    layer = PackedLinear(plain, prefill_dtype=torch.int8)
    prompt, step = torch.randn(INT8_PREFILL_ROWS, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    layer.make_prefill_copy()
    assert layer.prefill_weight.dtype == torch.int8
    assert torch.equal(layer(prompt), Int8Weight(plain.weight, plain.bias).matmul(prompt).to(torch.bfloat16))
    assert torch.equal(
        layer(step), torch.ops.mkldnn._linear_pointwise(step, layer.packed_weight, layer.bias, "none", [], "")
    )


def test_a_float32_layer_runs_prompts_on_its_int8_copy_once_made():
    torch.manual_seed(3)
    plain = torch.nn.Linear(64, 48)
    layer = PromptInt8Linear(plain)
    prompt, step = torch.randn(INT8_PREFILL_ROWS, 64), torch.randn(INT8_PREFILL_ROWS - 1, 64)
    assert layer.prefill_copy_pending and torch.equal(layer(prompt), plain(prompt))
    layer.make_prefill_copy()
    assert not layer.prefill_copy_pending
    assert torch.equal(layer(prompt), Int8Weight(plain.weight, plain.bias).matmul(prompt))
    assert torch.equal(layer(step), plain(step))
