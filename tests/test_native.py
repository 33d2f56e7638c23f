"""vlserve's own int8/int4 decode kernels: built once, int8 equal to the stock path bit for bit, int4 the
exact sum of what it rounds, and never in the way where they cannot run (no compiler, a failed build,
a CPU or torch held below AVX-512 VNNI)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import NATIVE_KERNELS
from vlserve import native
from vlserve.loader import load_model
from vlserve.quantized import INT4_GROUP, Int4Weight, Int8Weight, _int4_groups, int4_blocks, quantize_rows
from vlserve.settings import LimitSettings, ModelSettings
from vlserve.weightcache import WeightCache

CPU_REASON = native.cpu_reason()
needs_vnni = pytest.mark.skipif(CPU_REASON is not None, reason="the kernel cannot run here: %s" % CPU_REASON)


@pytest.fixture
def fresh_state(monkeypatch):
    """`native.enable` as a new process sees it (it keeps its first outcome for the process)."""
    monkeypatch.setattr(native, "_state", native._State())


@pytest.fixture(scope="module")
def ops():
    if CPU_REASON is not None:
        pytest.skip("the kernels cannot run here: %s" % CPU_REASON)
    path, _ = native.build(pathlib.Path(NATIVE_KERNELS))
    torch.ops.load_library(str(path))
    return torch.ops.vlserve


@pytest.fixture(scope="module")
def kernel(ops):
    return ops.int8_linear


@pytest.fixture
def loaded(fresh_state):
    """The kernels loaded as a worker loads them."""
    if CPU_REASON is not None:
        pytest.skip("the kernels cannot run here: %s" % CPU_REASON)
    status = native.enable(pathlib.Path(NATIVE_KERNELS))
    assert status.startswith("vlserve's int8/int4 decode kernels "), status


def stock(weight: Int8Weight, rows: torch.Tensor) -> torch.Tensor:
    """The Python path the kernel replaces: inputs rounded per row, `torch._int_mm`, rescaled."""
    values, row_scales = quantize_rows(rows)
    out = torch._int_mm(values, weight.values.t()).float().mul_(row_scales[:, None]).mul_(weight.scales)
    return out if weight.bias is None else out.add_(weight.bias)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (4099, 2048), (12, 6144)])
def test_the_kernel_equals_the_stock_int8_path_bit_for_bit(kernel, shape, dtype):
    """Every row count it takes (1-4), with and without a bias, outputs not a multiple of its tile of
    four, rows of wildly different scales and a row of zeros; bfloat16 rows get the float32 result
    rounded to bfloat16, as the layer would round it."""
    torch.manual_seed(sum(shape))
    outputs, inputs = shape
    for bias in (None, torch.randn(outputs)):
        weight = Int8Weight(torch.randn(outputs, inputs) * torch.rand(outputs, 1), bias, prepack=False)
        for rows in range(1, native.MAX_ROWS + 1):
            x = (torch.randn(rows, inputs) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
            if rows == 3:
                x[1] = 0
            got = kernel(x, weight.values, weight.scales, weight.bias)
            assert got.dtype == dtype and got.shape == (rows, outputs)
            assert torch.equal(got, stock(weight, x).to(dtype))


@needs_vnni
def test_the_kernel_is_close_to_the_float_product(kernel):
    torch.manual_seed(7)
    weight, x = torch.randn(256, 2048), torch.randn(2, 2048)
    layer = Int8Weight(weight, prepack=False)
    got = kernel(x, layer.values, layer.scales, None)
    assert float((got - x @ weight.t()).norm() / (x @ weight.t()).norm()) < 0.02


@needs_vnni
def test_the_kernel_refuses_what_it_cannot_multiply(kernel):
    weight = Int8Weight(torch.randn(8, 128), prepack=False)
    for x, values, message in (
        (torch.randn(5, 128), weight.values, "1 to 4 rows"),
        (torch.randn(1, 96), torch.zeros(8, 96, dtype=torch.int8), "multiples of 64"),
        (torch.randn(1, 128), weight.values.float(), "contiguous int8"),
        (torch.randn(1, 128), weight.values.t().contiguous().t(), "contiguous int8"),
    ):
        with pytest.raises(RuntimeError, match=message):
            kernel(x, values, weight.scales if values.shape[0] == 8 else torch.ones(values.shape[0]), None)


def test_an_int8_weight_uses_the_kernel_for_decode_rows_only(loaded, monkeypatch):
    """Up to four rows of a layer whose inputs are a multiple of 64 go through the kernel; prompts and
    other layers through `torch._int_mm` on the same plain values, which stay plain (no oneDNN reorder)."""
    calls = []
    loaded = native.int8_linear()
    monkeypatch.setattr(native, "int8_linear", lambda: lambda *args: calls.append(args[0].shape) or loaded(*args))
    torch.manual_seed(3)
    weight = Int8Weight(torch.randn(32, 128), torch.randn(32))
    assert weight.packed is None and not weight.layout_pending
    for rows in (1, 4, 5, 40):
        weight.matmul(torch.randn(rows, 128))
    Int8Weight(torch.randn(32, 96)).matmul(torch.randn(1, 96))
    assert calls == [(1, 128), (4, 128)]


def test_a_second_build_loads_the_first_and_a_new_source_builds_anew(tmp_path, monkeypatch):
    """(Building needs only a compiler, whatever the CPU.)"""
    first, built = native.build(tmp_path)
    assert built and first.is_file()
    stamp = first.stat().st_mtime_ns
    again, built = native.build(tmp_path)
    assert (again, built) == (first, False) and again.stat().st_mtime_ns == stamp
    changed = tmp_path / "changed.cpp"
    changed.write_text(native.SOURCE.read_text() + "\n// another revision\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    other, built = native.build(tmp_path)
    assert built and other != first and first.is_file()
    assert sorted(path.name for path in tmp_path.glob("*.so*")) == sorted([first.name, other.name])  # no partial


def test_workers_starting_together_build_it_once(tmp_path):
    """Two processes build into one empty directory at once: one compiles, the other waits for it."""
    script = "import pathlib, sys; from vlserve import native; print(native.build(pathlib.Path(sys.argv[1]))[1])"
    runs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = sorted(run.communicate(timeout=600)[0].strip() for run in runs)
    assert outputs == ["False", "True"]
    assert len(list(tmp_path.glob("*.so"))) == 1


def test_a_failed_build_leaves_the_stock_kernels_with_its_reason(tmp_path, monkeypatch, fresh_state):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    if native.cpu_reason() is None:
        status = native.enable(tmp_path / "kernels")
        assert status.startswith("stock kernels: the build with") and "failed" in status
        assert "\n" not in status
    with pytest.raises(native.NativeUnavailable, match="failed"):
        native.build(tmp_path / "kernels")
    assert native.int8_linear() is None
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no partial file either
    weight = Int8Weight(torch.randn(16, 64), prepack=False)  # and the stock path still multiplies
    assert weight.matmul(torch.randn(1, 64)).shape == (1, 16)


def test_without_a_compiler_the_reason_says_what_to_install(tmp_path, monkeypatch, fresh_state):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(native.NativeUnavailable, match=re.escape("no C++ compiler (install g++")):
        native.build(tmp_path)
    if native.cpu_reason() is None:
        assert native.enable(tmp_path) == "stock kernels: no C++ compiler (install g++, or set CXX)"


def test_switched_off_it_is_not_built(tmp_path, fresh_state):
    assert native.enable(None) == "stock kernels: switched off (native_kernels: off)"
    assert native.int8_linear() is None


@needs_vnni
def test_torch_held_to_avx2_keeps_the_stock_kernels(tmp_path):
    """As a laptop is imitated here (ATEN_CPU_CAPABILITY=avx2): the kernel, which needs AVX-512, is not
    loaded even though this CPU has it, so an AVX2 measurement measures what an AVX2 host runs."""
    script = textwrap.dedent(
        """
        import pathlib, sys
        from vlserve import native
        print(native.enable(pathlib.Path(sys.argv[1])))
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip().startswith("stock kernels: torch runs its kernels at AVX2"), result.stderr
    assert not list(tmp_path.iterdir())  # nothing built


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_the_int4_kernel_sums_the_rounded_weights_and_inputs(ops, rows, dtype):
    """Its result is the float64 sum of what it rounds: the weights' levels, scales and lows (bfloat16),
    the inputs in int8 blocks of 32; one row at a time or two, over blocks of 64 outputs; in the rows'
    dtype."""
    torch.manual_seed(rows)
    outputs, inputs = 192, 6 * INT4_GROUP
    levels, scales, lows = _int4_groups(torch.randn(outputs, inputs) * torch.rand(outputs, 1), INT4_GROUP)
    x = (torch.randn(rows, inputs) * torch.logspace(-2, 2, inputs)).to(dtype)
    blocks, block_scales = quantize_rows(x.float().reshape(-1, INT4_GROUP))
    rounded = (blocks.double() * block_scales.double()[:, None]).reshape(rows, inputs)
    weight = levels.double() * scales.bfloat16().double().repeat_interleave(INT4_GROUP, 1)
    weight += lows.bfloat16().double().repeat_interleave(INT4_GROUP, 1)
    got = ops.int4_linear(x, int4_blocks(levels, scales, lows))
    assert got.dtype == dtype and got.shape == (rows, outputs)
    expected = rounded @ weight.t()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # plus bfloat16's rounding of the result
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=1e-5 * float(expected.abs().max()))


@needs_vnni
def test_the_int4_kernel_refuses_a_layout_it_does_not_know(ops):
    blocks = int4_blocks(*_int4_groups(torch.randn(64, 64), INT4_GROUP))
    for x, b, message in (
        (torch.randn(1, 48), blocks, "groups of 32"),
        (torch.randn(1, 64), blocks[:, :-1].contiguous(), "blocks must be"),
        (torch.randn(1, 64), blocks.view(torch.int8), "blocks must be"),
    ):
        with pytest.raises(RuntimeError, match=message):
            ops.int4_linear(x, b)


def test_an_int4_weight_takes_the_kernels_layout_and_keeps_it_through_the_cache(loaded):
    torch.manual_seed(11)
    weight, bias = torch.randn(128, 4 * INT4_GROUP), torch.randn(128)
    layer = Int4Weight(weight, bias)
    assert layer.tiled and set(layer.tensors()) == {"blocks", "bias"}
    assert not Int4Weight(torch.randn(48, 4 * INT4_GROUP)).tiled  # outputs not a multiple of 64: torch's layout
    again = Int4Weight.from_tensors(layer.tensors())
    assert (again.tiled, again.shape, again.group) == (True, layer.shape, layer.group)
    rows = torch.randn(3, 4 * INT4_GROUP)
    assert torch.equal(again.matmul(rows), layer.matmul(rows))
    # Within half a rounding step of each group (plus the bfloat16 scales), as the stock layout.
    grouped = weight.reshape(128, 4, INT4_GROUP)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    error = (layer.dequantized().reshape(128, 4, INT4_GROUP) - grouped).abs().amax(-1)
    assert torch.all(error <= 0.5 * step + 2e-2 * grouped.abs().amax(-1))
    exact = rows @ weight.t() + bias
    assert float((layer.matmul(rows) - exact).norm() / exact.norm()) < 0.1


def test_int4_cache_files_are_kept_per_layout(loaded, tmp_path):
    """Switching the kernels (a setting, a CPU held to AVX2) maps the other layout's file, never this one."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    tiled = WeightCache(tmp_path / "cache", checkpoint, "int4")
    assert tiled.key["int4_layout"] == "blocks" and tiled.path.name.endswith("-int4-blocks.safetensors")
    native._state = native._State()  # restored by fresh_state
    native.enable(None)
    stock = WeightCache(tmp_path / "cache", checkpoint, "int4")
    assert stock.key["int4_layout"] == "int4pack" and stock.path != tiled.path
    assert "int4_layout" not in WeightCache(tmp_path / "cache", checkpoint, "int8").key


def test_a_worker_at_int4_maps_the_file_of_the_layout_its_kernels_take(tiny_model, tmp_path, fresh_state):
    """The kernels load before the weight cache is opened: with them, int4 weights are tiled and live in
    their own file; without them (switched off), the stock layout's file; the answers agree."""
    if CPU_REASON is not None:
        pytest.skip("the kernels cannot run here: %s" % CPU_REASON)

    def load(kernels):
        settings = ModelSettings(
            model=tiny_model, quantize="int4", weight_cache=str(tmp_path), native_kernels=kernels, warmup=False
        )
        loaded = load_model(settings, LimitSettings(max_batch_size=1), lambda message: None)
        loaded.settle()
        layers = [
            module.stored
            for module in loaded.model.modules()
            if isinstance(getattr(module, "stored", None), Int4Weight)
        ]
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.arange(40)[None]).logits[0, -1]
        return {layer.tiled for layer in layers}, logits

    tiled, with_kernels = load(NATIVE_KERNELS)
    assert tiled == {True} and [path.name.rsplit("-", 2)[1:] for path in tmp_path.glob("*.safetensors")] == [
        ["int4", "blocks.safetensors"]
    ]
    native._state = native._State()  # a new process, with the kernels switched off
    plain, stock = load("off")
    assert plain == {False} and len(list(tmp_path.glob("*-int4-int4pack.safetensors"))) == 1
    assert float((with_kernels - stock).norm() / stock.norm()) < 0.05
