"""vlserve's own kernels: built once; the int8 product its Q8_0 reference on every ISA tier and equal
across tiers bit for bit; int4 the exact sum of what it rounds; the norm and rotary ops transformers'
own; and never in the way where they cannot run (no compiler, a failed build, a CPU or torch held
below a tier's ISA). Expectations come from native's own predicates (`cpu_tier`, `cpu_tiers`), not
from the CPU the tests were written on."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLTextRMSNorm,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_vision,
)

from conftest import NATIVE_KERNELS, VENV_BIN, run_tool
from vlserve.kernels import checks, native, record, reference
from vlserve.kernels.formats import INT4_GROUP, int4_blocks, int4_groups, q8_tiles, quantize_blocks
from vlserve.kernels.quantized import Int4Weight, Int8Weight
from vlserve.kernels.reference import q8_reference
from vlserve.model import attention, decoderops, mapped, network
from vlserve.model.loader import load_model
from vlserve.model.weightcache import WeightCache
from vlserve.settings import LimitSettings, ModelSettings

TIER, TIER_WHY = native.cpu_tier()  # the tier a worker here loads
CPU_TIERS = native.cpu_tiers()  # every tier this CPU's instructions allow (ops can be asked for any)
stock_rotary = apply_rotary_pos_emb  # transformers' own: the network's (decoderops.STOCK_ROTARY) is held to it too
needs_tier = pytest.mark.skipif(TIER is None, reason="no kernel tier runs here: %s" % TIER_WHY)
needs_avx512 = pytest.mark.skipif(TIER != "avx512_vnni", reason="the op needs the AVX-512 VNNI tier: %s" % TIER_WHY)
HAS_BF16 = TIER == "avx512_vnni" and native.BF16_FLAG in (native._cpu_flags() or [])
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the bfloat16 kernel needs AVX-512 VNNI and BF16")
SERVES_PROMPTS = HAS_BF16 and native.AMX_FLAG not in (native._cpu_flags() or [])
needs_amx = pytest.mark.skipif(not (HAS_BF16 and native.amx_allowed()), reason="the AMX product needs AMX BF16")


@pytest.fixture
def fresh_state(monkeypatch):
    """`native.load` as a new process sees it (it keeps its first outcome for the process)."""
    monkeypatch.setattr(native, "_outcome", None)


@pytest.fixture(scope="module")
def ops():
    if not CPU_TIERS:
        pytest.skip("no kernel tier runs on this CPU: %s" % TIER_WHY)
    path, _ = native.build(pathlib.Path(NATIVE_KERNELS))
    torch.ops.load_library(str(path))
    return torch.ops.vlserve


@pytest.fixture
def loaded(fresh_state):
    """The kernels loaded as a worker loads them."""
    if TIER is None:
        pytest.skip("the kernels cannot run here: %s" % TIER_WHY)
    kernels = native.load(pathlib.Path(NATIVE_KERNELS))
    assert kernels.status.startswith("vlserve's kernels for %s (" % native.TIER_NAMES[TIER]), kernels.status
    assert kernels.tier == TIER
    return kernels


@pytest.mark.parametrize("tier", CPU_TIERS or ["none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (4099, 2048), (12, 6144), (40, 96)])
def test_the_int8_product_is_its_q8_0_reference_on_every_tier(ops, tier, shape, dtype):
    """Every row count (decode steps and prompts), with and without a bias, outputs not a multiple of a
    tile, rows of wildly different scales, a row of zeros and a large channel: the float64 sum of the
    same rounded quantities, within float32's accumulation error (and bfloat16's rounding of the result)."""
    torch.manual_seed(sum(shape))
    outputs, inputs = shape
    values, scales = quantize_blocks(torch.randn(outputs, inputs) * torch.rand(outputs, 1), torch.float16)
    tiles = q8_tiles(values, scales)
    for bias in (None, torch.randn(outputs)):
        for rows in (1, 2, 3, 4, 6, 9, 37):
            x = torch.randn(rows, inputs) * torch.logspace(-3, 3, rows)[:, None]
            if rows > 2:
                x[1] = 0
                x[2, 7] *= 1000
            got = ops.q8_linear(x.to(dtype), tiles, bias, outputs, tier)
            assert got.dtype == dtype and got.shape == (rows, outputs)
            expected = q8_reference(x.to(dtype), values, scales, bias)
            slack = 1e-5 * expected.abs().amax(dim=1, keepdim=True) + expected.abs() * (
                2**-8 if dtype == torch.bfloat16 else 0
            )
            assert torch.all((got.double() - expected).abs() <= slack)


@pytest.mark.skipif(len(CPU_TIERS) < 2, reason="this CPU runs one tier only (%s)" % (CPU_TIERS or TIER_WHY))
def test_every_tier_gives_the_same_bits(ops):
    """The integers are exact and the float32 operations the same ones in the same order: what is measured
    on one tier (quant-check, the accuracy tests) holds on the others."""
    torch.manual_seed(9)
    for outputs, inputs, rows in ((2048, 2048, 1), (6144, 2048, 4), (100, 6144, 70)):
        values, scales = quantize_blocks(torch.randn(outputs, inputs), torch.float16)
        tiles, bias = q8_tiles(values, scales), torch.randn(outputs)
        x = torch.randn(rows, inputs)
        x[0, :5] *= 500
        for dtype in (torch.float32, torch.bfloat16):
            results = [ops.q8_linear(x.to(dtype), tiles, bias, outputs, tier) for tier in CPU_TIERS]
            assert all(torch.equal(result, results[0]) for result in results[1:])


@pytest.mark.parametrize("tier", CPU_TIERS or ["none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_int8_rows_are_the_bits_each_row_gets_alone(ops, tier, dtype):
    """Many rows take another path than a decode step's few (on AVX-512: more tiles and fewer rows a
    pass), and a decode step's rows stream as many tiles at once as their count leaves registers for,
    with the same sums in the same order: a token's result does not depend on how many rows came with
    it, so what quant-check measures on prompts holds for decode steps."""
    torch.manual_seed(11)
    outputs, inputs = 13 * 16 + 5, 24 * 32  # an odd number of tiles, the last one part empty
    values, scales = quantize_blocks(torch.randn(outputs, inputs) * torch.rand(outputs, 1), torch.float16)
    tiles, bias = q8_tiles(values, scales), torch.randn(outputs)
    x = (torch.randn(23, inputs) * torch.logspace(-2, 2, 23)[:, None]).to(dtype)
    x[3] = 0
    for b in (None, bias):
        alone = torch.cat([ops.q8_linear(x[row : row + 1], tiles, b, outputs, tier) for row in range(x.shape[0])])
        for count in (2, 4, 5, 7, x.shape[0]):
            assert torch.equal(ops.q8_linear(x[:count], tiles, b, outputs, tier), alone[:count])


def assert_torchs_rounding(got: torch.Tensor, wide: torch.Tensor) -> None:
    """`got` holds the bits torch's conversion gives `wide` in bfloat16, NaN where it has NaN (torch
    writes NaN as 0x7FC0 one value at a time and as 0xFFFF in vector lanes)."""
    expected = wide.bfloat16()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


@pytest.mark.parametrize("tier", CPU_TIERS or ["none"])
def test_bfloat16_results_are_torchs_rounding_of_the_float32_ones(ops, tier):
    """The kernels round their float32 sums to bfloat16 as torch's conversion does, in vector lanes:
    to nearest even, NaN kept NaN, and subnormal results kept (AVX-512 BF16's conversion flushes
    them), for a decode step's rows and a prompt's, through the int8 and the int4 products."""
    torch.manual_seed(17)
    outputs, inputs = 9 * 64 + 5, 8 * 32
    values, scales = quantize_blocks(torch.randn(outputs, inputs) * torch.rand(outputs, 1), torch.float16)
    tiles, bias = q8_tiles(values, scales), torch.randn(outputs)
    bias[[3, 70]] = float("nan")
    bias[[5, 100]] = float("inf")
    x = (torch.randn(37, inputs) * torch.logspace(-3, 3, 37)[:, None]).bfloat16()
    x[4] = (torch.randn(inputs) * 1e-40).bfloat16()  # subnormal inputs and results
    int4 = int4_blocks(*int4_groups(torch.randn(outputs - 5, inputs), INT4_GROUP)) if tier == "avx512_vnni" else None
    for rows in (1, 3, 4, 9, 37):
        for b in (None, bias):
            wide = ops.q8_linear(x[:rows].float(), tiles, b, outputs, tier)
            assert_torchs_rounding(ops.q8_linear(x[:rows], tiles, b, outputs, tier), wide)
        if int4 is not None:
            wide = ops.int4_linear(x[:rows].float(), int4)
            assert_torchs_rounding(ops.int4_linear(x[:rows], int4), wide)
    small = ops.q8_linear(x[4:5].float(), tiles, None, outputs, tier).abs()
    assert 0 < small.max() < torch.finfo(torch.float32).tiny  # that row's results are subnormal


def test_the_int8_product_refuses_what_it_cannot_multiply(ops):
    values, scales = quantize_blocks(torch.randn(40, 64), torch.float16)
    tiles = q8_tiles(values, scales)
    tier = CPU_TIERS[0]
    for x, t, outputs, isa, message in (
        (torch.randn(1, 48), tiles, 40, tier, "blocks of 32"),
        (torch.randn(1, 64), tiles, 60, tier, "3 tiles cannot hold 60 outputs"),
        (torch.randn(1, 64), tiles[:, :-1].contiguous(), 40, tier, "tiles must be contiguous uint8"),
        (torch.randn(1, 64), tiles.view(torch.int8), 40, tier, "tiles must be contiguous uint8"),
        (torch.randn(1, 64), tiles, 40, "sse2", "unknown ISA"),
    ):
        with pytest.raises(RuntimeError, match=message):
            ops.q8_linear(x, t, None, outputs, isa)
    for missing in sorted(set(native.TIERS) - set(CPU_TIERS)):  # a tier this CPU lacks is refused, not run
        with pytest.raises(RuntimeError, match="this CPU lacks"):
            ops.q8_linear(torch.randn(1, 64), tiles, None, 40, missing)


def test_an_int8_weight_multiplies_every_row_count_through_the_kernel(loaded, monkeypatch):
    """Decode steps and prompts alike (below AMX's bfloat16 route): the tiles are the only copy of the
    weight (no oneDNN reorder)."""
    calls = []
    kernel = loaded.q8_linear()
    counting = dataclasses.replace(loaded, amx=False)
    object.__setattr__(counting, "q8_linear", lambda: lambda *args: calls.append(args[0].shape) or kernel(*args))
    torch.manual_seed(3)
    weight = Int8Weight.on(counting)(torch.randn(32, 128), torch.randn(32))
    assert weight.tiles is not None and weight.values is None
    for rows in (1, 4, 5, 40):
        weight.matmul(torch.randn(rows, 128))
    assert calls == [(1, 128), (4, 128), (5, 128), (40, 128)]


def _amx_ops(ops):
    if not ops.amx_permitted():
        pytest.skip("Linux refuses AMX's tiles to this process")
    return ops


def _bfloat16_weight(outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 tiles of a random weight, and each weight times its block's scale rounded to bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    values, scales = quantize_blocks(torch.randn(outputs, inputs, generator=generator) * 3, torch.float16)
    exact = (values.float().reshape(outputs, -1, 32) * scales.float()[..., None]).reshape(outputs, inputs)
    return q8_tiles(values, scales), exact.bfloat16()


@needs_amx
@pytest.mark.parametrize("shape", [(1, 32, 16), (40, 96, 40), (64, 2048, 80), (100, 6144, 48), (33, 64, 5000)])
def test_the_amx_product_is_the_bfloat16_weights_sum_rounded_once(ops, shape):
    """Rows in passes of 32 (a partial last one, fewer than 16) times tiles in pairs (an odd one out,
    outputs not a multiple of 16), inputs from one block to 6144 (fewer tiles a task), thousands of
    outputs (many tasks): one-hot rows give back each weight exactly, as torch rounds w x d; random
    rows, with and without a bias, the float64 sum within float32's accumulation and one rounding."""
    rows, inputs, outputs = shape
    tiles, weight = _bfloat16_weight(outputs, inputs, sum(shape))
    amx = _amx_ops(ops)
    assert torch.equal(amx.q8_amx(torch.eye(inputs, dtype=torch.bfloat16), tiles, None, outputs), weight.t())
    x = torch.randn(rows, inputs).bfloat16()
    for bias in (None, torch.randn(outputs)):
        expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
        got = amx.q8_amx(x, tiles, bias, outputs)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
        slack = 1e-5 * (x.double().abs() @ weight.double().abs().t()) + expected.abs() * 2**-8
        assert torch.all((got.double() - expected).abs() <= slack)
    assert torch.equal(amx.q8_amx(x.t().contiguous().t(), tiles, None, outputs), amx.q8_amx(x, tiles, None, outputs))


@needs_amx
def test_the_amx_product_refuses_what_it_cannot_multiply(ops):
    tiles, _ = _bfloat16_weight(40, 64, 0)
    amx = _amx_ops(ops)
    for x, tiles_, bias, outputs, said in (
        (torch.randn(3, 64), tiles, None, 40, "bfloat16"),
        (torch.randn(3, 96).bfloat16(), tiles, None, 40, "shape"),
        (torch.randn(3, 48).bfloat16(), tiles, None, 40, "blocks of 32"),
        (torch.randn(3, 64).bfloat16(), tiles, torch.randn(39), 40, "one bias per output"),
        (torch.randn(3, 64).bfloat16(), tiles, None, 50, "shape"),
    ):
        with pytest.raises(RuntimeError, match=said):
            amx.q8_amx(x, tiles_, bias, outputs)


@needs_amx
def test_on_amx_long_bfloat16_products_take_its_tiles(loaded):
    """Where AMX runs (`Kernels.amx`), an int8 weight sends AMX_PROMPT_ROWS bfloat16 rows or more to its
    tiles, fewer rows (and float32 ones) to vlserve's int8 product; either is the product of the rounded
    weight, the AMX route without rounding the rows to int8, so nearer to it."""
    if not loaded.amx:
        pytest.skip("the loaded kernels do not run AMX here: %s" % loaded.status)
    calls = []
    on_amx = dataclasses.replace(loaded)
    kernel, amx = on_amx.q8_linear(), on_amx.q8_amx()
    object.__setattr__(on_amx, "q8_linear", lambda: lambda *args: calls.append(("int8", len(args[0]))) or kernel(*args))
    object.__setattr__(on_amx, "q8_amx", lambda: lambda *args: calls.append(("amx", len(args[0]))) or amx(*args))
    torch.manual_seed(5)
    weight = Int8Weight.on(on_amx)(torch.randn(48, 256), torch.randn(48))
    exact_weight = weight.dequantized().double()
    long_rows = native.AMX_PROMPT_ROWS
    errors = {}
    for rows, dtype in ((long_rows - 1, torch.bfloat16), (long_rows, torch.bfloat16), (long_rows, torch.float32)):
        x = torch.randn(rows, 256).to(dtype)
        exact = x.double() @ exact_weight.t() + weight.bias.double()
        got = weight.matmul(x)
        assert got.dtype == dtype and got.shape == (rows, 48)
        errors[rows, dtype] = float((got.double() - exact).norm() / exact.norm())
    assert calls == [("int8", long_rows - 1), ("amx", long_rows), ("int8", long_rows)]
    # bfloat16 weights and results (2^-9 each) against rows rounded to int8 per block of 32 (about 2^-8)
    assert errors[long_rows, torch.bfloat16] < 0.6 * errors[long_rows - 1, torch.bfloat16]
    assert max(errors.values()) < 0.02


@needs_bf16
@pytest.mark.parametrize("shape", [(5, 64), (4099, 2048), (12, 6144)])
def test_the_bf16_kernel_is_the_exact_sum_rounded_once(ops, shape):
    """1-4 rows (a decode step) and 9 (a short prompt: rows in groups of four over panels of weights),
    with and without a bias, outputs not a multiple of its tile of four, with and without prefetching
    (the same bits), each row as if alone: the float64 sum of the same bfloat16 values within one bfloat16
    rounding, plus float32's accumulation error."""
    torch.manual_seed(sum(shape))
    outputs, inputs = shape
    weight = (torch.randn(outputs, inputs) * torch.rand(outputs, 1)).bfloat16()
    for bias in (None, torch.randn(outputs).bfloat16()):
        for rows in (1, 2, 3, 4, 9):
            x = (torch.randn(rows, inputs) * torch.logspace(-2, 2, rows)[:, None]).bfloat16()
            exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            magnitude = x.double().abs() @ weight.double().abs().t()
            got = ops.bf16_linear(x, weight, bias, 1)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
            error = (got.double() - exact).abs()
            assert torch.all(error <= exact.abs() * 2.0**-8 + magnitude * 2.0**-16 + 1e-30), float(error.max())
            assert torch.equal(got, ops.bf16_linear(x, weight, bias, rows + 1)), "a prefetch moved a sum"
            alone = torch.cat([ops.bf16_linear(row[None], weight, bias, 1) for row in x])
            assert torch.equal(got, alone), "a row's sums depend on the rows that came with it"


@needs_bf16
def test_the_bf16_kernel_refuses_what_it_cannot_multiply(ops):
    weight = torch.randn(8, 64).bfloat16()
    for x, w, why in (
        (torch.randn(0, 64).bfloat16(), weight, "no rows"),
        (torch.randn(1, 64), weight, "rows must be bfloat16"),
        (torch.randn(1, 48).bfloat16(), torch.randn(8, 48).bfloat16(), "multiples of 32"),
        (torch.randn(1, 64).bfloat16(), torch.randn(64, 8).bfloat16().t(), "contiguous bfloat16"),
    ):
        with pytest.raises(RuntimeError, match=why):
            ops.bf16_linear(x, w, None, 1)


def test_the_bf16_prefetch_follows_the_vendor(loaded):
    """The library chooses (where its products choose the hint too) and the loaded kernels hand that
    choice to every bfloat16 product: from two rows on on AMD, from one elsewhere."""
    amd = record.cpuinfo_field("vendor_id") == "AuthenticAMD"
    assert loaded.prefetch_rows == loaded.ops.bf16_prefetch_rows() == (2 if amd else 1)


def _greedy_decode(model, steps: int = 16) -> tuple[list[int], torch.Tensor]:
    """A prompt, then `steps` one-row decode steps on a growing cache, as the engine runs them."""
    from vlserve.bench.decode import new_cache  # noqa: PLC0415

    cache = new_cache(model.config.text_config.num_hidden_layers)
    tokens, logits = [], []
    with torch.inference_mode():
        out = model(input_ids=torch.arange(100, 130)[None], cache=cache, logits_to_keep=1)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits.append(out.logits[0, -1].float())
            out = model(input_ids=token, cache=out.cache, logits_to_keep=1)
    return tokens, torch.stack(logits)


@needs_bf16
def test_an_exact_worker_decodes_through_the_bf16_kernel_as_the_packed_one_does(tiny_model, monkeypatch):
    """Where the plan packs bfloat16 weights and the kernel loads, the exact level keeps them plain for
    it: its decode rows go through the kernel, prompts through oneDNN, and the greedy tokens are the
    packed worker's. Its weights are multiplied where they lie in the checkpoint's map: nothing is
    copied, and nothing is left to do after ready."""
    from vlserve.model.packing import NativeBf16Weight, PackedBf16Weight  # noqa: PLC0415

    def load(kernels: str):
        monkeypatch.setattr(native, "_outcome", None)
        choices = {"quantize": "none", "dtype": "bfloat16", "packed_weights": True, "warmup": False}
        settings = ModelSettings(model=tiny_model, native_kernels=kernels, **choices)
        return load_model(settings, LimitSettings(max_batch_size=1), lambda _: None)

    packed = load("off")
    assert packed.choices.packed and isinstance(packed.model.lm_head.stored, PackedBf16Weight)
    packed.settle()
    expected, expected_logits = _greedy_decode(packed.model)

    own = load(NATIVE_KERNELS)
    assert own.choices.packed and own.choices.quantize == "none"  # the plan's choice, in the own product's layout
    weights = {id(m.stored): m.stored for m in own.model.modules() if hasattr(m, "stored")}
    assert weights and all(isinstance(w, NativeBf16Weight) for w in weights.values())
    calls = []
    for weight in weights.values():
        monkeypatch.setattr(weight, "op", lambda x, w, b, op=weight.op: (calls.append(x.shape[0]), op(x, w, b))[1])
    assert _greedy_decode(own.model)[0] == expected  # on views of the checkpoint
    assert calls and set(calls) == {1}  # decode rows only: the 30-row prompt went to oneDNN
    assert (own.layout_steps, own.prefill_copies) == ([], [])  # settled as soon as ready
    ranges = mapped.checkpoint_ranges()
    parts = [part for weight in weights.values() for part in weight.parts]
    assert ranges and all(any(low <= p.data_ptr() < high for low, high in ranges) for p in parts)
    # The tied output head is the input embedding itself, in the map for both.
    embedding = own.model.model.language_model.embed_tokens.weight
    assert [p.data_ptr() for p in own.model.lm_head.stored.parts] == [embedding.data_ptr()]
    tokens, logits = _greedy_decode(own.model)
    assert tokens == expected
    assert torch.allclose(logits, expected_logits, rtol=0.05, atol=0.05 * float(expected_logits.abs().max()))


def test_a_second_build_loads_the_first_and_a_new_source_builds_anew(tmp_path, monkeypatch):
    """(Building needs only a compiler, whatever the CPU.)"""
    first, built = native.build(tmp_path)
    assert built and first.is_file()
    stamp = first.stat().st_mtime_ns
    again, built = native.build(tmp_path)
    assert (again, built) == (first, False) and again.stat().st_mtime_ns == stamp
    changed = tmp_path / "changed.cpp"
    changed.write_text(native.SOURCES[-1].read_text() + "\n// another revision\n")
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES[:-1], changed))
    other, built = native.build(tmp_path)
    assert built and other != first and first.is_file()
    assert sorted(path.name for path in tmp_path.glob("*.so*")) == sorted([first.name, other.name])  # no partial


# A line at column 0 that declares something at namespace scope: a type's name, else the name before
# the first "(", "=", "[" or "{" (a function, a constant); target attributes and templates skipped.
_DECLARED_TYPE = re.compile(r"(?:struct|class|enum class|enum|union)\s+(\w+)")
_DECLARED = re.compile(r"[\w:<>,*&\s]*?\b(\w+)\s*[(=\[{]")


def file_local_names(source: str) -> set[str]:
    names = set()
    for line in source.splitlines():
        if not (line[:1].isalpha() or line[:1] == "_") or line.startswith(("namespace", "using", "template", "}")):
            continue
        bare = re.sub(r"__attribute__\(\(.*?\)\)\)?\s*", "", line)
        found = _DECLARED_TYPE.match(bare) or _DECLARED.match(bare)
        if found and not found.group(1).isupper():  # TORCH_LIBRARY_FRAGMENT and such are macros
            names.add(found.group(1))
    return names


def shared_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """The names more than one source declares, and where."""
    where: dict[str, list[str]] = {}
    for name, text in sources.items():
        for declared in file_local_names(text):
            where.setdefault(declared, []).append(name)
    return {declared: files for declared, files in where.items() if len(files) > 1}


def test_no_two_sources_declare_one_name_since_they_build_as_one_unit():
    """native._unit() includes every source in one translation unit, where their anonymous namespaces
    are one: a helper defined in two would not compile, or with other parameters would overload."""
    sources = {path.name: path.read_text() for path in native.SOURCES}
    assert shared_names(sources) == {}
    assert {"Isa", "round_row_avx512", "kStep"} <= file_local_names(sources["q8.cpp"])  # the scan finds them
    copied = {**sources, "copy.cpp": 'namespace {\n__attribute__((target("avx2"))) void round_row_avx512(int x) {\n'}
    assert shared_names(copied) == {"round_row_avx512": ["q8.cpp", "copy.cpp"]}  # a second definition is caught
    assert all(('#include "%s"' % path) in native._unit() for path in native.SOURCES)


def test_workers_starting_together_build_it_once(tmp_path):
    """Two processes build into one empty directory at once: one compiles, the other waits for it."""
    script = (
        "import pathlib, sys; from vlserve.kernels import native; print(native.build(pathlib.Path(sys.argv[1]))[1])"
    )
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
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES, broken))
    kernels = native.STOCK_KERNELS
    if TIER is not None:
        kernels = native.load(tmp_path / "kernels")
        assert kernels.status.startswith("stock kernels: the build with") and "failed" in kernels.status
        assert "\n" not in kernels.status
    with pytest.raises(native.NativeUnavailable, match="failed"):
        native.build(tmp_path / "kernels")
    assert kernels.q8_linear() is None and kernels.int8_layout() == "rows"
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no partial file either
    weight = Int8Weight.on(kernels)(torch.randn(16, 64))  # and torch's weight-only product still multiplies
    assert weight.tiles is None and weight.matmul(torch.randn(1, 64)).shape == (1, 16)


def test_without_a_compiler_the_reason_says_what_to_install(tmp_path, monkeypatch, fresh_state):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(native.NativeUnavailable, match=re.escape("no C++ compiler (install g++")):
        native.build(tmp_path)
    if TIER is not None:
        assert native.load(tmp_path).status == "stock kernels: no C++ compiler (install g++, or set CXX)"


def test_a_worker_that_must_not_build_loads_the_build_or_says_why_there_is_none(tmp_path, fresh_state, monkeypatch):
    """As deployed workers run (kernels_build off): what `vlserve kernels` built, else torch's with its record."""
    (tmp_path / record.BUILD_RECORD).write_text(json.dumps({"status": "stock kernels: no C++ compiler"}))
    kernels = native.load(tmp_path, build_missing=False)
    assert (
        kernels.status
        == "stock kernels: not built for this release and torch (vlserve kernels: stock kernels: no C++ compiler)"
    )
    assert not list(tmp_path.glob("*.so*"))  # nothing was compiled
    if TIER is not None:
        native.build(pathlib.Path(NATIVE_KERNELS))
        monkeypatch.setattr(native, "_outcome", None)  # a new process
        loaded = native.load(pathlib.Path(NATIVE_KERNELS), build_missing=False)
        assert loaded.ops is not None and "loaded from" in loaded.status


def _kernels_command(root: pathlib.Path, **env: str) -> dict:
    """`vlserve kernels --json` on `root` with these variables set: its record."""
    result = subprocess.run(
        [str(VENV_BIN / "vlserve"), "kernels", "--cache-dir", str(root), "--json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_kernels_command_builds_checks_records_and_prunes(tmp_path):
    """The deploy role's step, as it runs it; and without a compiler, the reason in the record, exit 0."""
    root = tmp_path / "kernels"
    root.mkdir()
    stale = root / "vlserve_kernels-0000000000000000.so"
    stale.write_bytes(b"an older build")
    if TIER is not None:  # the session's build, as if this step had made it before: no compile here
        built = native.library_path(pathlib.Path(NATIVE_KERNELS))
        native.build(pathlib.Path(NATIVE_KERNELS))
        (root / built.name).write_bytes(built.read_bytes())
    result = run_tool("vlserve", "kernels", "--cache-dir", str(root), "--json", timeout=600)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome == json.loads((root / record.BUILD_RECORD).read_text()) and outcome["checked"] is True
    assert outcome["expected"] == (TIER is not None) and outcome["own"] == (TIER is not None)
    if TIER is not None:
        assert outcome["library"] == str(native.library_path(root)) and outcome["built"] is False
        assert outcome["pruned"] == [str(stale)] and not stale.exists()
        # Run again with nothing changed: the record holds, torch is not imported, nothing is checked
        again = run_tool("vlserve", "kernels", "--cache-dir", str(root), "--json", timeout=600)
        assert json.loads(again.stdout) == {**outcome, "pruned": [], "checked": False}, again.stderr
        # ...but a change of its inputs (here torch held to another ISA) or a library gone checks again
        held = _kernels_command(root, ATEN_CPU_CAPABILITY="default")
        assert held["checked"] is True and not held["own"] and not held["expected"], held
        assert _kernels_command(root)["checked"] is True  # back to the recorded inputs: checked once more
        pathlib.Path(outcome["library"]).unlink()
        assert _kernels_command(root, PATH=str(tmp_path), CXX="")["checked"] is True  # a build attempted
    bare = tmp_path / "bare"
    bare.mkdir()
    for tool in ("python", "python3", "vlserve"):
        (bare / tool).symlink_to(VENV_BIN / tool)
    empty = tmp_path / "empty"
    no_compiler = subprocess.run(
        [str(VENV_BIN / "vlserve"), "kernels", "--cache-dir", str(empty), "--json"],
        env={**os.environ, "PATH": str(bare), "CXX": ""},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert no_compiler.returncode == 0, no_compiler.stderr
    refused = json.loads(no_compiler.stdout)
    assert not refused["own"]
    if TIER is not None:
        assert refused["expected"] and "no C++ compiler" in refused["status"]


def test_switched_off_it_is_not_built(tmp_path, fresh_state):
    kernels = native.load(None)
    assert kernels.status == "stock kernels: switched off (native_kernels: off)"
    assert kernels.q8_linear() is None and kernels.tier is None


@pytest.mark.skipif("avx2" not in CPU_TIERS, reason="this CPU cannot run the AVX2 tier")
def test_torch_held_to_avx2_loads_the_avx2_tier(tmp_path):
    """As an AVX2 host is imitated here (ATEN_CPU_CAPABILITY=avx2): the AVX2 tier loads even on a CPU
    with AVX-512, so a measurement held to AVX2 runs what an AVX2 host runs: the int8 product, the norm
    and the rotary; int4 weights and attention stay with torch."""
    script = textwrap.dedent(
        """
        import pathlib, sys
        from vlserve.kernels import native, reference
        kernels = native.load(pathlib.Path(sys.argv[1]))
        print(kernels.status)
        print(kernels.tier, kernels.int4_linear() is None, kernels.one_query_attention() is None)
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    status, tiers = result.stdout.strip().splitlines()
    assert status.startswith("vlserve's kernels for AVX2 (int8 products, norm, rotary) built into"), result.stderr
    assert tiers == "avx2 True True"


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 19])
def test_the_int4_kernel_sums_the_rounded_weights_and_inputs(ops, rows, dtype):
    """Its result is the float64 sum of what it rounds: the weights' levels, scales and lows (bfloat16),
    the inputs in int8 blocks of 32; a decode step's rows (up to 4) or a prompt's (8 a pass, and the
    rest), over blocks of 64 outputs (enough that each thread streams several together); in the rows' dtype."""
    torch.manual_seed(rows)
    outputs, inputs = 11 * 64, 6 * INT4_GROUP
    levels, scales, lows = int4_groups(torch.randn(outputs, inputs) * torch.rand(outputs, 1), INT4_GROUP)
    x = (torch.randn(rows, inputs) * torch.logspace(-2, 2, inputs)).to(dtype)
    blocks, block_scales = quantize_blocks(x.float())
    rounded = (blocks.double().reshape(rows, -1, INT4_GROUP) * block_scales.double()[..., None]).reshape(rows, inputs)
    weight = levels.double() * scales.bfloat16().double().repeat_interleave(INT4_GROUP, 1)
    weight += lows.bfloat16().double().repeat_interleave(INT4_GROUP, 1)
    got = ops.int4_linear(x, int4_blocks(levels, scales, lows))
    assert got.dtype == dtype and got.shape == (rows, outputs)
    expected = rounded @ weight.t()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # plus bfloat16's rounding of the result
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=1e-5 * float(expected.abs().max()))


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_int4_rows_are_the_bits_each_row_gets_alone(ops, dtype):
    """The prompt path (more than 4 rows) adds each row's sums in the decode path's order, and a decode
    step's rows stream as many blocks at once as their count leaves registers for: a token's result does
    not depend on how many rows came with it."""
    torch.manual_seed(7)
    outputs, inputs = 11 * 64, 8 * INT4_GROUP
    blocks = int4_blocks(*int4_groups(torch.randn(outputs, inputs), INT4_GROUP))
    x = torch.randn(21, inputs).to(dtype)
    alone = torch.cat([ops.int4_linear(x[row : row + 1], blocks) for row in range(x.shape[0])])
    for count in (2, 3, 4, x.shape[0]):
        assert torch.equal(ops.int4_linear(x[:count], blocks), alone[:count])


@needs_avx512
def test_the_int4_kernel_refuses_a_layout_it_does_not_know(ops):
    blocks = int4_blocks(*int4_groups(torch.randn(64, 64), INT4_GROUP))
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
    on_loaded = Int4Weight.on(loaded)
    layer = on_loaded(weight, bias)
    tiled = loaded.int4_layout() == "blocks"  # the AVX-512 VNNI tier's layout; torch's int4pack elsewhere
    assert layer.tiled == tiled and ("blocks" in layer.tensors()) == tiled and "bias" in layer.tensors()
    assert not on_loaded(torch.randn(48, 4 * INT4_GROUP)).tiled  # outputs not a multiple of 64: torch's layout
    again = on_loaded.from_tensors(layer.tensors())
    assert (again.tiled, again.shape, again.group) == (tiled, layer.shape, layer.group)
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
    loaded_layouts = loaded.int8_layout(), loaded.int4_layout()  # q8tiles on every tier; blocks on AVX-512 VNNI
    tiled = WeightCache(tmp_path / "cache", checkpoint, "int4", loaded)
    assert tiled.key["int4_layout"] == loaded_layouts[1]
    assert tiled.path.name.endswith("-int4-%s-%s.safetensors" % loaded_layouts)
    stock = WeightCache(tmp_path / "cache", checkpoint, "int4", native.STOCK_KERNELS)
    assert stock.key["int4_layout"] == "int4pack" and stock.path.name.endswith("-int4-rows-int4pack.safetensors")
    assert "int4_layout" not in WeightCache(tmp_path / "cache", checkpoint, "int8", loaded).key


def test_a_worker_at_int4_maps_the_file_of_the_layout_its_kernels_take(tiny_model, tmp_path, fresh_state):
    """The kernels load before the weight cache is opened: with them, int4 weights are tiled and live in
    their own file; without them (switched off), the stock layout's file; the answers agree."""
    if TIER != "avx512_vnni":
        pytest.skip("int4 weights take vlserve's layout on the AVX-512 VNNI tier only: %s" % TIER_WHY)

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
            logits = loaded.model(input_ids=torch.arange(3)[None]).logits[0, -1]  # decode rows: int4 both ways
        return {layer.tiled for layer in layers}, logits

    tiled, with_kernels = load(NATIVE_KERNELS)
    assert tiled == {True} and [path.name.rsplit("-", 3)[1:] for path in tmp_path.glob("*.safetensors")] == [
        ["int4", "q8tiles", "blocks.safetensors"]
    ]
    native._outcome = None  # a new process, with the kernels switched off (restored by fresh_state)
    plain, stock = load("off")
    assert plain == {False} and len(list(tmp_path.glob("*-int4-rows-int4pack.safetensors"))) == 1
    # The same int4 levels; the kernel rounds inputs per block of 32 where torch's takes bfloat16, and the
    # head is Q8_0 against one scale a row: the logits agree within 10%.
    assert float((with_kernels - stock).norm() / stock.norm()) < 0.1


@needs_tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (4, 1, 16, 128), (1, 300, 2048)])
def test_the_norm_op_is_transformers_rmsnorm_within_its_rounding(ops, shape, dtype):
    """float32: a few units in the last place (the sum of squares adds in another order, and the
    difference passes through three roundings); bfloat16: one unit, where the float32 value was a tie."""
    torch.manual_seed(len(shape))
    norm = Qwen3VLTextRMSNorm(shape[-1], eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(shape[-1]).to(dtype)
    x = (torch.randn(shape) * torch.logspace(-2, 2, shape[-2])[:, None]).to(dtype)
    expected = norm(x)
    got = ops.rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = checks.NORM_TOLERANCE[dtype]
    assert torch.all((got.float() - expected.float()).abs() <= expected.float().abs() * tolerance)
    if dtype == torch.bfloat16:  # the same roundings: a float32 difference shows only at a tie
        assert (got == expected).float().mean() > 0.99
    strided = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, not contiguous
    assert torch.equal(ops.rms_norm(strided, norm.weight, 1e-6), got)


@needs_tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (4, 1), (2, 37)])
@pytest.mark.parametrize("dim", [128, 40])
def test_the_rotary_op_is_transformers_rotary_bit_for_bit(ops, batch, tokens, dtype, dim):
    """On the transposed views the attention hands it, and with one table broadcast over the batch;
    128 dimensions (the model's) take the vectors in bfloat16, 40 the general path."""
    torch.manual_seed(batch + tokens)
    q = torch.randn(batch, tokens, 16, dim).to(dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, 8, dim).to(dtype).transpose(1, 2)
    for table_batch in (batch, 1):
        cos, sin = torch.randn(2, table_batch, tokens, dim).to(dtype)
        expected = stock_rotary(q, k, cos, sin)
        got = ops.rotary(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(decoderops.STOCK_ROTARY(q, k, cos, sin), expected, strict=True))


@needs_tier
@pytest.mark.parametrize("dim", [64, 40])
def test_the_rotary_op_is_the_vision_towers_rotary_bit_for_bit(ops, dim):
    """bfloat16 queries and keys (views of the fused qkv product, as the tower hands them) and float32
    tables: products and sum in float32, rounded once; 64 dimensions (the tower's) take the vectors,
    40 the general path; values near bfloat16's largest overflow to infinity alike."""
    torch.manual_seed(dim)
    qkv = (torch.randn(37, 3, 4, dim) * torch.logspace(-3, 3, dim)).bfloat16()
    qkv[0, :2, 0, : dim // 2 + 1 : dim // 2] = 3.3e38  # the first and the rotated-in value: their sum overflows
    q, k, _ = qkv.permute(1, 0, 2, 3).unbind(0)
    cos, sin = torch.randn(2, 37, dim)
    cos[0], sin[0] = 1.0, 1.0
    expected = apply_rotary_pos_emb_vision(q, k, cos, sin)  # transformers' own: the network's is held to it too
    assert all(torch.equal(a, b) for a, b in zip(network.apply_vision_rotary(q, k, cos, sin), expected, strict=True))
    got = decoderops.vision_rotary_op(q, k, cos, sin, op=ops.rotary)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert expected[0][0, 0, dim // 2].isinf()


@needs_tier
def test_the_decoder_ops_refuse_what_they_do_not_take(ops):
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rms_norm(torch.randn(2, 64), torch.randn(64).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.rms_norm(torch.randn(2, 64).half(), torch.randn(64).half(), 1e-6)
    with pytest.raises(RuntimeError, match="must be \\(batch, heads, tokens, dim\\)"):
        ops.rotary(torch.randn(1, 2, 64), torch.randn(1, 1, 1, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64))


def test_a_quantized_worker_runs_its_norms_and_rotary_through_the_ops(loaded, tiny_model):
    """Every norm of the language model (two a layer, the query and key norms, the final one) and its
    rotary; the vision tower keeps its norms, its rotary takes the op; the logits are the stock
    modules' within their rounding."""
    settings = ModelSettings(model=tiny_model, quantize="int4", native_kernels=NATIVE_KERNELS, warmup=False)
    model = load_model(settings, LimitSettings(max_batch_size=1), lambda message: None).model
    text = model.model.language_model
    native_norms = [module for module in model.modules() if isinstance(module, decoderops.NativeRMSNorm)]
    assert len(native_norms) == 4 * len(text.layers) + 1
    assert not any(isinstance(module, network.RMSNorm) for module in text.modules())
    assert not any(isinstance(module, decoderops.NativeRMSNorm) for module in model.model.visual.modules())
    assert all(layer.self_attn.rotary.func is decoderops.rotary_op for layer in text.layers)
    assert all(block.attn.rotary.func is decoderops.vision_rotary_op for block in model.model.visual.blocks)
    ids, positions = torch.arange(40)[None], network.text_positions(1, 0, 40)
    with torch.inference_mode():
        fused = model(ids, None, positions).logits[0, -1]
        for parent in list(text.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, decoderops.NativeRMSNorm):
                    stock = network.RMSNorm(child.weight.shape[0], child.variance_epsilon)
                    stock.weight = child.weight
                    setattr(parent, name, stock)
        for layer in text.layers:
            layer.self_attn.rotary = network.apply_rotary
        reference = model(ids, None, positions).logits[0, -1]
    assert float((fused - reference).norm() / reference.norm()) < 0.01


@needs_avx512
@pytest.mark.parametrize(
    ("batch", "tokens", "mask_kind", "heads_and_dim"),
    # Qwen3-VL's shape (16 query heads over 8 key heads of 128) has a path of its own; one query head
    # a key head, and other head sizes, take the general one.
    [
        (1, 1, None, (16, 128)),
        (1, 41, None, (16, 128)),
        (4, 300, "bool", (16, 128)),
        (3, 17, "add", (16, 128)),
        (2, 23, "bool", (8, 128)),
        (2, 29, "add", (16, 64)),
    ],
)
def test_the_attention_op_is_the_python_path_within_its_rounding(ops, batch, tokens, mask_kind, heads_and_dim):
    """On views of a cache buffer with headroom (as kvcache hands them), left-padded sequences masked.
    Its float32 sums add in another order: where that moves a bfloat16 rounding, by one unit."""
    heads, dim = heads_and_dim
    torch.manual_seed(tokens)
    key = torch.randn(batch, 8, tokens + 64, dim).bfloat16()[:, :, :tokens]
    value = torch.randn(batch, 8, tokens + 64, dim).bfloat16()[:, :, :tokens]
    query = torch.randn(batch, 1, heads, dim).bfloat16().transpose(1, 2)
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool)
        mask[1:, ..., :5] = False
    elif mask_kind == "add":
        mask = torch.zeros(batch, 1, 1, tokens)
        mask[0, ..., :3] = float("-inf")
    expected = attention.one_query_attention(query, key, value, mask, scaling=dim**-0.5)
    got = ops.one_query_attention(query, key, value, mask, dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=2**-7 * float(expected.abs().max()))
    assert (got == expected).float().mean() > 0.98


@pytest.mark.parametrize("tier", CPU_TIERS or ["none"])
def test_the_memory_read_sums_every_byte_on_every_tier(ops, tier):
    """Whole passes, a tail shorter than a pass, and buffers parallel_for splits between threads (their
    shares join exactly); a view into a larger buffer reads only its own bytes."""
    generator = torch.Generator().manual_seed(3)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for size in (0, 1, 63, 256, 4096 + 255, (3 << 20) + 5):
            data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
            assert ops.stream_read(data, tier) == int(data.sum(dtype=torch.int64)), size
        whole = torch.full((10_000,), 255, dtype=torch.uint8)
        assert ops.stream_read(whole[1000:1300], tier) == 300 * 255
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(RuntimeError, match="contiguous 1-d uint8"):
        ops.stream_read(torch.zeros(4, 4, dtype=torch.uint8), tier)
    with pytest.raises(RuntimeError, match="contiguous 1-d uint8"):
        ops.stream_read(torch.zeros(8), tier)
    with pytest.raises(RuntimeError, match="unknown ISA"):
        ops.stream_read(torch.zeros(8, dtype=torch.uint8), "sse2")


@needs_avx512
def test_the_attention_op_refuses_what_it_does_not_take(ops):
    query, key = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 5, 32)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.one_query_attention(torch.randn(1, 4, 2, 32), key, key, None, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16 and contiguous"):
        ops.one_query_attention(query, key.transpose(2, 3).contiguous().transpose(2, 3), key, None, 1.0)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        ops.one_query_attention(query, key.bfloat16(), key, None, 1.0)
    two = torch.randn(2, 2, 5, 32)
    with pytest.raises(RuntimeError, match="the mask's rows are not the batch's"):
        ops.one_query_attention(torch.randn(2, 4, 1, 32), two, two, torch.ones(3, 1, 1, 5, dtype=torch.bool), 1.0)


@needs_avx512
@pytest.mark.parametrize(
    "rows,width",
    [(1, 6144), (4, 6144), (8, 6144), (64, 6144), (2, 64), (8, 8), (16, 12), (3, 37), (5, 100), (1, 7)],
)
def test_silu_mul_is_aten_silu_times_up_to_the_bit(ops, rows, width):
    """The decoder layer's SiLU and product in one pass (kernels/decode_vnni.cpp): the bits of
    at::silu(gate) * up on this CPU's ATen kernels, vectors across rows' ends included, and
    infinities, NaN and values far out in the gate; sizes where ATen's loops would leave a tail to
    their scalar forms (or ATen runs without vectors) it refuses, and the layer keeps ATen there."""
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).bfloat16()
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 88.0, -88.0, 1e-30, -0.0, 200.0])
    gate_up[0, : min(width, len(specials))] = specials[: min(width, len(specials))].bfloat16()
    expected = torch.nn.functional.silu(gate_up[:, :width].contiguous()) * gate_up[:, width:].contiguous()
    if not ops.silu_mul_exact(rows * width):
        assert (rows * width) % 64 or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
        with pytest.raises(RuntimeError, match="would not round as at::silu and at::mul"):
            ops.silu_mul(gate_up)
        return
    got = ops.silu_mul(gate_up)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_the_attention_op_gives_zeros_where_a_sequence_has_nothing_to_attend_to(ops):
    """As the prompt attention op: a fully masked row is zeros (torch's softmax would make it NaN),
    and the other sequences of the batch are as they would be alone."""
    torch.manual_seed(5)
    key = torch.randn(2, 8, 9, 128).bfloat16()
    value = torch.randn(2, 8, 9, 128).bfloat16()
    query = torch.randn(2, 16, 1, 128).bfloat16()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0] = False
    out = ops.one_query_attention(query, key, value, mask, 0.088)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    alone = ops.one_query_attention(query[1:], key[1:], value[1:], None, 0.088)
    assert torch.equal(out[1:], alone)


@needs_bf16
@pytest.mark.parametrize(
    ("shape", "dim", "mask_kind"),
    # An image's patches (16 heads of 64 a key head, no mask), a causal prompt, a batch whose second
    # row is left-padded (its first queries attend to nothing), an additive mask, a prompt after a
    # stored prefix (fewer queries than keys); tokens not a multiple of the op's blocks.
    [
        ((1, (16, 16), 45, 45), 64, None),
        ((1, (16, 8), 37, 37), 128, "causal"),
        ((2, (16, 8), 21, 21), 128, "padded"),
        ((2, (4, 2), 19, 19), 64, "add"),
        ((2, (16, 8), 9, 40), 128, "prefix"),
    ],
)
def test_the_prompt_attention_op_is_its_reference_within_its_rounding(ops, shape, dim, mask_kind):
    """Queries as the vision tower hands them (a transposed view), keys and values as views of a
    cache with headroom. Its float32 sums add in another order: where that moves a bfloat16 rounding, by one unit."""
    batch, heads, queries, tokens = shape
    torch.manual_seed(tokens)
    query_heads, key_heads = heads
    query = torch.randn(batch, queries, query_heads, dim).bfloat16().transpose(1, 2)
    key = torch.randn(batch, key_heads, tokens + 16, dim).bfloat16()[:, :, :tokens]
    value = torch.randn(batch, key_heads, tokens + 16, dim).bfloat16()[:, :, :tokens]
    mask = None
    if mask_kind in {"causal", "padded", "prefix"}:
        mask = torch.ones(queries, tokens, dtype=torch.bool).tril(tokens - queries).expand(batch, 1, -1, -1).clone()
        if mask_kind == "padded":
            mask[1, ..., :6] = False
    elif mask_kind == "add":
        mask = torch.randn(batch, 1, queries, tokens)
        mask[0, ..., :3] = float("-inf")
    expected = reference.prompt_attention(query, key, value, mask, scaling=dim**-0.5)
    got = ops.prompt_attention(query, key, value, mask, dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, queries, query_heads, dim)
    odd_rows = torch.empty(batch, key_heads, tokens, dim + 1).bfloat16()[..., :dim].copy_(key)  # rows dim + 1 apart
    assert torch.equal(ops.prompt_attention(query, odd_rows, value, mask, dim**-0.5), got)
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=2**-7 * float(expected.abs().max()))
    assert (got == expected).float().mean() > 0.98
    if mask_kind == "padded":  # queries with nothing to attend to: zeros, not NaN
        assert torch.equal(got[1, :6].float(), torch.zeros(6, query_heads, dim))
    if mask_kind != "padded":  # where every query attends, torch's own attention agrees too
        stock = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        assert torch.allclose(got.float(), stock, rtol=2**-6, atol=2**-6 * float(stock.abs().max()))


@needs_bf16
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_the_prompt_attention_op_reads_no_key_past_the_last_one_a_block_of_queries_attends_to(ops, mask_dtype):
    """A causal prompt's first 16 queries attend to its first 16 keys: keys and values past the op's
    next multiple of 32 are not read for them (NaN there changes nothing), and their results are the
    bits of the same prompt cut to those 32 tokens; later queries, which attend there, see the NaN."""
    torch.manual_seed(5)
    tokens, dim = 80, 128
    query = torch.randn(1, tokens, 16, dim).bfloat16().transpose(1, 2)
    key, value = torch.randn(2, 1, 8, tokens, dim).bfloat16()
    allowed = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    mask = allowed if mask_dtype == torch.bool else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    clean = ops.prompt_attention(query, key, value, mask, dim**-0.5)
    key[:, :, 32:], value[:, :, 32:] = float("nan"), float("nan")
    spoiled = ops.prompt_attention(query, key, value, mask, dim**-0.5)
    assert torch.equal(spoiled[:, :16], clean[:, :16])
    assert spoiled[:, 32:].isnan().all()
    cut = ops.prompt_attention(query[:, :, :32], key[:, :, :32], value[:, :, :32], mask[..., :32, :32], dim**-0.5)
    assert torch.equal(cut, clean[:, :32])


@needs_bf16
def test_the_prompt_attention_op_refuses_what_it_does_not_take(ops):
    query, key = torch.randn(1, 4, 3, 64).bfloat16(), torch.randn(1, 2, 5, 64).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 64 and contiguous"):
        ops.prompt_attention(query[..., :32], key[..., :32], key[..., :32], None, 1.0)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        ops.prompt_attention(query.float(), key.float(), key.float(), None, 1.0)
    with pytest.raises(RuntimeError, match="mask must be"):
        ops.prompt_attention(query, key, key, torch.ones(1, 1, 3, 4, dtype=torch.bool), 1.0)


@pytest.mark.skipif(not SERVES_PROMPTS, reason="the prompt attention op serves AVX-512 BF16 CPUs without AMX")
@pytest.mark.parametrize("mask_kind", [None, "padded"])
def test_prompts_attend_through_the_op_where_it_is_loaded_as_sdpa_would(loaded, mask_kind):
    """transformers' reading of the arguments is kept: no mask on a causal layer is a causal mask,
    a boolean mask is taken as it is; float32 stays with sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

    calls = []
    op = loaded.prompt_attention()
    counting = dataclasses.replace(loaded)
    object.__setattr__(counting, "prompt_attention", lambda: lambda *args: calls.append(args) or op(*args))
    torch.manual_seed(3)
    query = torch.randn(2, 16, 12, 128).bfloat16()
    key, value = torch.randn(2, 8, 12, 128).bfloat16(), torch.randn(2, 8, 12, 128).bfloat16()
    mask = None
    if mask_kind == "padded":
        mask = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 1, 12, 12).clone()
        mask[1, ..., :2] = False
        mask[1, :, :2, 0] = True  # sdpa would give NaN to a query with nothing to attend to
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 2, True
    out, _ = attention.attention(layer, query, key, value, mask, kernels=counting)
    expected, _ = sdpa_attention_forward(layer, query.float(), key.float(), value.float(), mask)
    assert len(calls) == 1 and out.shape == (2, 12, 16, 128)
    assert torch.allclose(out.float(), expected, rtol=2**-6, atol=2**-6 * float(expected.abs().max()))
    attention.attention(layer, query.float(), key.float(), value.float(), mask, kernels=counting)  # float32: sdpa
    assert len(calls) == 1


@needs_avx512
def test_a_decode_step_attends_through_the_op_where_it_is_loaded(loaded):
    calls = []
    op = loaded.one_query_attention()
    counting = dataclasses.replace(loaded)
    object.__setattr__(counting, "one_query_attention", lambda: lambda *args: calls.append(args) or op(*args))
    query = torch.randn(1, 1, 16, 128).bfloat16().transpose(1, 2)
    key = value = torch.randn(1, 8, 7, 128).bfloat16()
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 2, True
    out, _ = attention.attention(layer, query, key, value, None, kernels=counting, scaling=None)
    assert len(calls) == 1 and calls[0][4] == 128**-0.5 and out.shape == (1, 1, 16, 128)
    attention.attention(layer, query.float(), key.float(), value.float(), None, kernels=counting)  # float32: sdpa
    assert len(calls) == 1
