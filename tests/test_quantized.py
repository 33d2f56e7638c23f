"""Quantized kernels: each matches the dequantized float reference within its own rounding."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from conftest import run_tool
from vlserve import native, quantized
from vlserve.packing import PackedLinear, packing_supported
from vlserve.quantized import (
    INT4_GROUP,
    INT8_PREFILL_ROWS,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    PromptInt8Linear,
    quantize_rows,
    quantize_vision_tower,
    shifted_rows,
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


@pytest.fixture(autouse=True)
def stock_kernels(monkeypatch):
    """torch's kernels only: vlserve's own (native.py), loaded by any earlier test of the process, has its
    tests in test_native.py."""
    monkeypatch.setattr(native, "_state", native._State())


@pytest.fixture(params=["onednn", "weight_int8pack_mm"])
def int8_backend(request, monkeypatch):
    """Both stock int8 products: oneDNN's prepacked one, and torch's weight-only one where oneDNN is missing."""
    if request.param == "onednn" and not quantized.onednn_int8_supported():
        pytest.skip("this torch build has no oneDNN int8 products")
    if request.param != "onednn":
        monkeypatch.setattr(quantized, "onednn_int8_supported", lambda: False)
    return request.param


def test_the_int8_product_is_the_integer_product_rescaled(int8_backend):
    torch.manual_seed(1)
    weight, bias, rows = torch.randn(48, 96), torch.randn(48), torch.randn(20, 96) * 3
    layer = Int8Weight(weight, bias)
    assert (layer.packed is not None) == (int8_backend == "onednn")
    q_weight, weight_scales = quantize_rows(weight)
    assert torch.allclose(layer.dequantized(), q_weight.float() * weight_scales[:, None], rtol=1e-6, atol=0)
    if int8_backend == "onednn":  # inputs rounded per row too, integer sums exact
        q_rows, row_scales = quantize_rows(rows)
        exact = (q_rows.long() @ q_weight.long().t()).double() * row_scales.double()[:, None] * weight_scales.double()
    else:  # exact inputs
        exact = rows.double() @ layer.dequantized().double().t()
    assert torch.allclose(layer.matmul(rows).double(), exact + bias.double(), rtol=1e-5, atol=1e-5)
    # And close to the float product: 255 levels per row give well under 2% on Gaussian data.
    assert relative_error(layer.matmul(rows), rows @ weight.t() + bias) < 0.02


def test_an_int8_weight_left_in_its_plain_layout_gives_the_same_products_before_and_after_it(int8_backend):
    """The loader leaves oneDNN's reorder to after ready: until then `torch._int_mm` multiplies the plain
    values (the same integer sums), and a weight from the cache (`from_tensors`) is the same weight."""
    torch.manual_seed(2)
    weight, bias = torch.randn(48, 96), torch.randn(48)
    ready = Int8Weight(weight, bias)
    deferred = Int8Weight(weight, bias, prepack=False)
    mapped = Int8Weight.from_tensors(deferred.tensors())
    assert deferred.layout_pending == mapped.layout_pending == (int8_backend == "onednn")
    for rows in (torch.randn(1, 96), torch.randn(20, 96) * 3):
        before = deferred.matmul(rows)
        assert torch.equal(mapped.matmul(rows), before)
        assert torch.allclose(before, ready.matmul(rows), rtol=1e-5, atol=1e-5)
    for layer in (deferred, mapped):
        layer.finish_layout()
        assert not layer.layout_pending
        assert torch.equal(layer.matmul(rows), ready.matmul(rows))
    if int8_backend == "onednn":
        assert deferred.values is None  # the plain values (a view of the cache file) are let go
        with pytest.raises(ValueError):
            deferred.tensors()


def test_an_int4_weight_from_its_tensors_is_the_same_weight():
    torch.manual_seed(3)
    weight, bias = torch.randn(32, 128), torch.randn(32)
    layer = Int4Weight(weight, bias)
    again = Int4Weight.from_tensors(layer.tensors())
    assert (again.shape, again.group) == (layer.shape, layer.group)
    rows = torch.randn(3, 128)
    assert torch.equal(again.matmul(rows), layer.matmul(rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_are_rounded_for_onednn_exactly_as_quantize_rows_rounds_them(dtype):
    torch.manual_seed(5)
    for rows in (torch.randn(1, 256) * 1e-3, torch.randn(7, 256) * 1e3, torch.zeros(2, 256)):
        shifted, scales = shifted_rows(rows.to(dtype))
        values, expected = quantize_rows(rows.to(dtype))
        assert shifted.dtype == torch.uint8 and torch.equal(shifted, (values.to(torch.int16) + 128).to(torch.uint8))
        assert torch.equal(scales, expected)


def test_a_big_weight_is_quantized_in_chunks_with_the_same_result(monkeypatch):
    torch.manual_seed(4)
    weight = torch.randn(304, 64)
    whole = Int8Weight(weight).dequantized(), Int4Weight(weight).dequantized()
    monkeypatch.setattr(quantized, "QUANTIZE_CHUNK_ROWS", 7)
    assert torch.equal(Int8Weight(weight).dequantized(), whole[0])
    assert torch.equal(Int4Weight(weight).dequantized(), whole[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weights_are_within_half_a_step_of_their_group_and_the_product_is_their_product(dtype):
    torch.manual_seed(5)
    weight = torch.randn(64, 4 * INT4_GROUP) * torch.linspace(0.01, 3.0, 64)[:, None]
    weight[3, :INT4_GROUP] = 0.25  # a constant group stays exact
    bias, rows = torch.randn(64), torch.randn(9, 4 * INT4_GROUP).to(dtype)
    layer = Int4Weight(weight, bias)
    grouped = weight.reshape(64, 4, INT4_GROUP)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    # Half a step, plus the bfloat16 rounding of the scales and zero points the kernel reads.
    tolerance = 0.5 * step + 2e-2 * grouped.abs().amax(-1)
    error = (layer.dequantized().reshape(64, 4, INT4_GROUP) - grouped).abs().amax(-1)
    assert torch.all(error <= tolerance)
    assert torch.allclose(layer.dequantized()[3, :INT4_GROUP], torch.full((INT4_GROUP,), 0.25), atol=2e-3)
    # The kernel reads its inputs as bfloat16, whatever their dtype, and sums in float32.
    reference = rows.bfloat16().double() @ layer.dequantized().double().t() + bias.double()
    out = layer.matmul(rows)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), reference, rtol=1e-2, atol=1e-2 * float(reference.abs().max()))
    # 16 levels per group of 32: a few percent from the float product on Gaussian data.
    assert relative_error(out, rows.float() @ weight.t() + bias) < 0.1


@pytest.mark.parametrize("shape", [(16, INT4_GROUP + 1), (8, INT4_GROUP)])
def test_int4_refuses_a_shape_its_layout_cannot_hold(shape):
    with pytest.raises(ValueError, match="int4 needs inputs in groups of 32 and outputs in blocks of 16"):
        Int4Weight(torch.randn(*shape))


def test_int8_linear_keeps_shape_and_dtype():
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    out = Int8Linear.from_linear(linear)(torch.randn(2, 7, 64).to(torch.bfloat16))
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
        layer(step), torch.ops.mkldnn._linear_pointwise(step, layer.weight.packed, layer.weight.bias, "none", [], "")
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


def test_quant_check_reports_agreement_and_divergence_for_each_level(tiny_bf16, tmp_path):
    output = tmp_path / "check.json"
    result = run_tool(
        "vlserve", "quant-check", "--model", str(tiny_bf16), "--prompts", "2", "--answer-tokens", "6",
        "--output", str(output), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| int8 |" in result.stdout and "| int4 |" in result.stdout
    data = json.loads(output.read_text())
    assert (data["prompts"], data["answer_tokens"]) == (2, 6)
    for level in ("int8", "int4"):
        figures = data["levels"][level]
        assert figures["quantize"] == level and figures["positions"] == 12
        assert 0 <= figures["agreement"] <= 1 and 0 < figures["kl_mean"] <= figures["kl_max"]
    # Four bits round more than eight: on the same prompts, a larger divergence.
    assert data["levels"]["int4"]["kl_mean"] > data["levels"]["int8"]["kl_mean"]


def test_quant_check_refuses_a_directory_that_is_no_checkpoint(tmp_path):
    result = run_tool("vlserve", "quant-check", "--model", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("has no config.json: not a Hugging Face checkpoint")


def test_bench_decode_measures_every_level_and_counts_fewer_bytes_per_token_as_it_rounds(tiny_bf16, tmp_path):
    output = tmp_path / "decode.json"
    result = run_tool(
        "vlserve", "bench-decode", "--model", str(tiny_bf16), "--tokens", "3", "--rounds", "2", "--threads", "1",
        "--output", str(output), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(output.read_text())
    levels = data["levels"]
    assert list(levels) == ["none", "int8", "int4"] and levels["none"]["speedup"] == 1
    for figures in levels.values():
        assert figures["tokens_per_s"] > 0 and figures["step_ms_range"][0] <= figures["step_ms"]
        assert figures["rss_anon_bytes"] > 0  # read from /proc (Linux)
        assert len(figures["step_ms_rounds"]) == 2 and min(figures["step_ms_rounds"]) == figures["step_ms_range"][0]
        low, high = figures["speedup_rounds_range"]
        assert low <= high and figures["speedup_vs_first_best"] <= figures["speedup"]
    assert levels["none"]["speedup_rounds_range"] == [1, 1]
    sizes = [levels[level]["decode_bytes_per_token"] for level in ("none", "int8", "int4")]
    assert sizes[0] > sizes[1] > sizes[2] > 0
    assert "| int4 |" in result.stdout or "| int4 | " in result.stdout
