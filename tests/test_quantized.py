"""Quantized kernels: each matches the dequantized float reference within its own rounding."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from conftest import NATIVE_KERNELS, run_tool
from vlserve.kernels import native, quantized
from vlserve.kernels.formats import INT4_GROUP, Q8_BLOCK, q8_tiles, q8_untiled, quantize_blocks, quantize_rows
from vlserve.kernels.quantized import (
    INT8_PREFILL_ROWS,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    PromptInt8Linear,
)
from vlserve.kernels.reference import q8_reference
from vlserve.model.checkpoint import load_network
from vlserve.model.packing import PackedLinear, packing_supported, quantize_vision_tower


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


def test_a_channel_far_larger_than_the_rest_coarsens_its_own_block_of_32_only():
    """Blocks of 32 (llama.cpp's Q8_0): every block within half of its own step, zero blocks zero, and an
    outlier channel 1000 times the rest leaves the other blocks as fine as without it, where one scale
    per row rounds them all to nothing."""
    torch.manual_seed(0)
    rows = torch.randn(3, 4 * Q8_BLOCK)
    rows[1, Q8_BLOCK : 2 * Q8_BLOCK] = 0
    rows[2, 5] *= 1000
    values, scales = quantize_blocks(rows)
    assert values.dtype == torch.int8 and scales.shape == (3, 4) and values.abs().max() <= 127
    blocks = rows.reshape(3, 4, Q8_BLOCK)
    rounded = values.float().reshape(3, 4, Q8_BLOCK) * scales[..., None]
    assert torch.all((rounded - blocks).abs() <= scales[..., None] / 2 * (1 + 1e-6))
    assert scales[1, 1] == 0 and torch.equal(
        values[1, Q8_BLOCK : 2 * Q8_BLOCK], torch.zeros(Q8_BLOCK, dtype=torch.int8)
    )
    others = slice(Q8_BLOCK, None)  # row 2 past the outlier's block
    assert relative_error(rounded.reshape(3, -1)[2, others], rows[2, others]) < 0.01
    per_row = quantize_rows(rows[2:])[0].float() * quantize_rows(rows[2:])[1][:, None]
    assert relative_error(per_row[0, others], rows[2, others]) > 0.5
    # fp16 scales, as weights keep them: the values are rounded against the stored scale.
    values16, scales16 = quantize_blocks(rows, torch.float16)
    assert scales16.dtype == torch.float16
    assert torch.all((values16.float().reshape(3, 4, Q8_BLOCK) * scales16.float()[..., None] - blocks).abs()
                     <= scales16.float()[..., None] / 2 * (1 + 1e-3))  # fmt: skip


@pytest.mark.parametrize("outputs", [16, 40, 5])
def test_the_tiles_hold_every_output_s_values_and_scales(outputs):
    torch.manual_seed(outputs)
    values, scales = quantize_blocks(torch.randn(outputs, 3 * Q8_BLOCK), torch.float16)
    tiles = q8_tiles(values, scales)
    assert tiles.dtype == torch.uint8 and tiles.shape == (-(-outputs // 16), 3 * 544)
    back_values, back_scales = q8_untiled(tiles, outputs)
    assert torch.equal(back_values, values) and torch.equal(back_scales, scales)


@pytest.fixture(autouse=True)
def stock_kernels(monkeypatch):
    """No kernels loaded unless a test asks for them: each test sees a process that has not loaded them."""
    monkeypatch.setattr(native, "_outcome", None)


TIER, TIER_WHY = native.cpu_tier()


class Backend(str):
    """The name of an int8 backend ("kernels", "weight-only"), carrying the kernels it runs on."""

    kernels: native.Kernels


@pytest.fixture(params=["kernels", "weight-only"])
def int8_backend(request):
    """Both int8 products: vlserve's kernels at this CPU's tier (Q8_0, inputs rounded per block), and
    torch's weight-only product where they cannot load (one scale per row, exact inputs)."""
    backend = Backend(request.param)
    backend.kernels = native.STOCK_KERNELS
    if request.param == "kernels":
        if TIER is None:
            pytest.skip("vlserve's kernels cannot run here: %s" % TIER_WHY)
        backend.kernels = native.load(pathlib.Path(NATIVE_KERNELS))
        assert backend.kernels.status.startswith("vlserve's kernels for")
        assert backend.kernels.int8_layout() == "q8tiles"
    return backend


def test_the_int8_product_is_its_reference(int8_backend):
    torch.manual_seed(1)
    weight, bias, rows = torch.randn(48, 96), torch.randn(48), torch.randn(20, 96) * 3
    layer = Int8Weight.on(int8_backend.kernels)(weight, bias)
    assert (layer.tiles is not None) == (int8_backend == "kernels")
    if int8_backend == "kernels":  # Q8_0 weights, inputs rounded per block, integer sums exact
        values, scales = quantize_blocks(weight, torch.float16)
        assert torch.equal(
            layer.dequantized(), (values.float().reshape(48, 3, 32) * scales.float()[..., None]).reshape(48, 96)
        )
        expected = q8_reference(rows, values, scales, bias)
    else:  # one scale per row, exact inputs
        values, scales = quantize_rows(weight)
        assert torch.allclose(layer.dequantized(), values.float() * scales[:, None], rtol=1e-6, atol=0)
        expected = rows.double() @ layer.dequantized().double().t() + bias.double()
    assert torch.allclose(layer.matmul(rows).double(), expected, rtol=1e-5, atol=1e-5)
    # And close to the float product: 255 levels per block or row give well under 2% on Gaussian data.
    assert relative_error(layer.matmul(rows), rows @ weight.t() + bias) < 0.02


def test_an_int8_weight_from_its_tensors_is_the_same_weight(int8_backend):
    """The weight cache maps `tensors()` back (`from_tensors`): the same products, not a copy."""
    torch.manual_seed(2)
    weight, bias = torch.randn(40, 96), torch.randn(40)
    layer = Int8Weight.on(int8_backend.kernels)(weight, bias)
    mapped = Int8Weight.on(int8_backend.kernels).from_tensors(layer.tensors())
    assert mapped.shape == layer.shape == (40, 96)
    for rows in (torch.randn(1, 96), torch.randn(20, 96).bfloat16()):
        assert torch.equal(mapped.matmul(rows), layer.matmul(rows))
    assert mapped.nbytes == layer.nbytes


def test_an_int4_weight_from_its_tensors_is_the_same_weight():
    torch.manual_seed(3)
    weight, bias = torch.randn(32, 128), torch.randn(32)
    layer = Int4Weight(weight, bias)
    again = Int4Weight.from_tensors(layer.tensors())
    assert (again.shape, again.group) == (layer.shape, layer.group)
    rows = torch.randn(3, 128)
    assert torch.equal(again.matmul(rows), layer.matmul(rows))


def test_a_big_weight_is_quantized_in_chunks_with_the_same_result(monkeypatch, int8_backend):
    torch.manual_seed(4)
    weight = torch.randn(304, 64)
    whole = (
        Int8Weight.on(int8_backend.kernels)(weight).dequantized(),
        Int4Weight.on(int8_backend.kernels)(weight).dequantized(),
    )
    monkeypatch.setattr(quantized, "QUANTIZE_CHUNK_ROWS", 16 if int8_backend == "kernels" else 7)
    assert torch.equal(Int8Weight.on(int8_backend.kernels)(weight).dequantized(), whole[0])
    assert torch.equal(Int4Weight.on(int8_backend.kernels)(weight).dequantized(), whole[1])


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


def test_int8_linear_keeps_shape_and_dtype(int8_backend):
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    out = Int8Linear.from_linear(linear, int8_backend.kernels)(torch.randn(2, 7, 64).to(torch.bfloat16))
    assert out.shape == (2, 7, 32) and out.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny-bf16"
    assert run_tool("vlserve", "make-test-model", str(directory)).returncode == 0
    return directory


def test_the_vision_tower_in_int8_stays_close_to_float32(tiny_bf16, int8_backend):
    model = load_network(tiny_bf16, torch.float32)
    grid = torch.tensor([[1, 8, 8]])
    config = model.config.vision_config
    pixels = torch.randn(64, config.in_channels * config.temporal_patch_size * config.patch_size**2)
    with torch.inference_mode():
        reference = model.model.get_image_features(pixels, grid).pooler_output[0]
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.model.visual.modules())
        assert quantize_vision_tower(model.model.visual, kernels=int8_backend.kernels) == linears > 0
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
    layer = PromptInt8Linear(plain, native.STOCK_KERNELS)
    prompt, step = torch.randn(INT8_PREFILL_ROWS, 64), torch.randn(INT8_PREFILL_ROWS - 1, 64)
    assert layer.prefill_copy_pending and torch.equal(layer(prompt), plain(prompt))
    layer.make_prefill_copy()
    assert not layer.prefill_copy_pending
    assert torch.equal(layer(prompt), Int8Weight(plain.weight, plain.bias).matmul(prompt))
    assert torch.equal(layer(step), plain(step))


def test_quant_check_reports_agreement_divergence_and_where_each_level_ran(tmp_path):
    """On a checkpoint shaped like real weights (outlier channels in its residual streams): each level's
    figures, and the ISA tier and kernels it ran on, as vlserve.kernels.native would pick them on this CPU."""
    checkpoint = tmp_path / "tiny-outliers"
    assert run_tool("vlserve", "make-test-model", str(checkpoint), "--outlier-channels", "4").returncode == 0
    output = tmp_path / "check.json"
    result = run_tool(
        "vlserve", "quant-check", "--model", str(checkpoint), "--prompts", "2", "--answer-tokens", "6",
        "--output", str(output), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| int8 |" in result.stdout and "| int4 |" in result.stdout
    data = json.loads(output.read_text())
    assert (data["prompts"], data["answer_tokens"]) == (2, 6)
    tier, _ = native.cpu_tier()
    for level in ("int8", "int4"):
        figures = data["levels"][level]
        assert figures["quantize"] == level and figures["positions"] == 12
        assert 0 <= figures["agreement"] <= 1 and 0 < figures["kl_mean"] <= figures["kl_max"]
        assert len(figures["kl_prompt_means"]) == 2 and figures["kl_median"] <= figures["kl_p99"] <= figures["kl_max"]
        if tier is None:  # no kernels here: torch's, at the capability it runs
            assert figures["isa"].startswith("torch at ") and figures["kernels"].startswith("stock kernels: ")
        else:
            assert figures["isa"] == native.TIER_NAMES[tier], figures
            assert figures["kernels"].startswith("vlserve's kernels for %s (" % native.TIER_NAMES[tier]), figures
        assert "| %s |" % figures["isa"] in result.stdout
    # Four bits round more than eight: on the same prompts, a larger divergence.
    assert data["levels"]["int4"]["kl_mean"] > data["levels"]["int8"]["kl_mean"]


def test_quant_check_refuses_a_directory_that_is_no_checkpoint(tmp_path):
    result = run_tool("vlserve", "quant-check", "--model", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("has no config.json: not a Hugging Face checkpoint")


def test_bench_decode_measures_every_level_and_counts_fewer_bytes_per_token_as_it_rounds(tiny_bf16, tmp_path):
    # A copy no weight cache knows: the first load of each quantized level rounds, untimed; no timed round does.
    model = tmp_path / "model"
    shutil.copytree(tiny_bf16, model)
    output = tmp_path / "decode.json"
    result = run_tool(
        "vlserve", "bench-decode", "--model", str(model), "--tokens", "3", "--rounds", "2", "--threads", "1",
        "--cache-history", "fresh", "aged", "--output", str(output), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(output.read_text())
    levels = data["levels"]
    assert list(levels) == ["none", "int8", "int4"] and levels["none"]["speedup"] == 1
    assert levels["int8"]["first_load"]["rounded_layers"] > 0 and levels["int4"]["first_load"]["rounded_layers"] > 0
    low, high = data["read_bandwidth_range"]
    assert 0 < low <= data["read_bandwidth_bytes_per_s"] <= high
    assert "torch.dot" in data["read_bandwidth_readers"]  # the bound is the fastest reader's, turn by turn
    for figures in levels.values():
        assert figures["rounded_layers_in_rounds"] == 0 and figures["first_load"]["seconds"] > 0
        for count in ("1", "4"):  # each round's steps against the read speeds on both sides of each
            share = figures["of_bound"][count]
            assert 0 < share["range"][0] <= share["median"] <= share["range"][1]
        assert figures["tokens_per_s"] > 0 and figures["step_ms_range"][0] <= figures["step_ms"]
        assert figures["rss_bytes"] > figures["rss_anon_bytes"] > 0  # read from /proc (Linux): code is file pages
        assert len(figures["step_ms_rounds"]) == 2 and min(figures["step_ms_rounds"]) == figures["step_ms_range"][0]
        low, high = figures["speedup_rounds_range"]
        assert low <= high and figures["speedup_vs_first_best"] <= figures["speedup"]
    assert levels["none"]["speedup_rounds_range"] == [1, 1]
    for level, figures in levels.items():  # before each turn its level's weight files took that round's history
        weights = figures["first_load"]["weight_files"]
        assert str(model / "model.safetensors") in weights and all(name.endswith(".safetensors") for name in weights)
        assert [r["history"] for r in figures["cache_history_rounds"]] == ["fresh", "aged"]
        steps = figures["step_ms_rounds"]
        assert figures["by_cache_history"]["aged"]["step_ms"] == steps[1]
        assert figures["step_spread"] == pytest.approx(max(steps) / min(steps) - 1)
        assert "%s, decode step by page-cache history: fresh %.1f ms" % (level, steps[0]) in result.stdout
    sizes = [levels[level]["decode_bytes_per_token"] for level in ("none", "int8", "int4")]
    assert sizes[0] > sizes[1] > sizes[2] > 0
    for figures in levels.values():  # four sequences decoded together (--batches' default), timed too
        batch = figures["batches"]["4"]
        assert 0 < batch["step_ms_range"][0] <= batch["step_ms"] <= batch["step_ms_range"][1]
        # Their attention reads four sequences' keys and values: four times one's.
        assert figures["kv_bytes_per_step"]["4"] == 4 * figures["kv_bytes_per_step"]["1"] > 0
    assert "4 sequences: step (of its bound)" in result.stdout
    assert "memory read speed, measured between each turn's steps" in result.stdout
    assert "| int4 |" in result.stdout or "| int4 | " in result.stdout
