"""The self-checks a freshly loaded kernel library passes before any op serves (vlserve.kernels.native
loads it, then calls `check`): each op of the tier against a reference computed in Python on a few
shapes, so a miscompiled build is never used. A failure raises `Mismatch`, whose message becomes the
kernels' status line (torch's kernels then serve)."""

from __future__ import annotations

import torch

from vlserve.kernels import reference
from vlserve.kernels.formats import INT4_GROUP, int4_blocks, int4_groups, q8_tiles, quantize_blocks

# How far the norm op may be from transformers' RMSNorm, relative: its float32 sum of squares adds in
# another order, which moves a float32 result by a few units in the last place and a bfloat16 one
# by at most one (where the float32 value was near a tie).
NORM_TOLERANCE = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 2 * 2.0**-7}


class Mismatch(Exception):
    """Which op's check differed from its reference, in one line."""


def check(ops, tier: str, bf16: bool, amx: bool = False) -> None:
    """The loaded kernels of `tier` against references on a few shapes: a miscompiled build is not used.
    int8: the exact sum of the same rounded quantities (float64), within float32's accumulation error.
    int4: the same rounded quantities summed in float64."""
    generator = torch.Generator().manual_seed(0)
    for rows, inputs, outputs in ((1, 64, 5), (3, 96, 40), (6, 128, 70), (11, 64, 40)):  # 11: a prompt's path
        values, scales = quantize_blocks(torch.randn(outputs, inputs, generator=generator), torch.float16)
        bias = torch.randn(outputs, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, inputs, generator=generator) * 10.0 ** torch.arange(rows)[:, None]).to(dtype)
            expected = reference.q8_reference(x, values, scales, bias)
            got = ops.q8_linear(x, q8_tiles(values, scales), bias, outputs, tier).double()
            # float32 sums: off by a few units of the row's largest term; bfloat16 rounds each result.
            slack = 1e-5 * expected.abs().amax(dim=1, keepdim=True)
            if not torch.all(
                (got - expected).abs() <= slack + expected.abs() * (2**-8 if dtype == torch.bfloat16 else 0)
            ):
                raise Mismatch("its int8 check differs from the reference by %.3g" % (got - expected).abs().max())
    if tier == "avx512_vnni":
        _check_int4(ops, generator)
    if bf16:
        _check_bf16(ops, generator)
    if amx:
        _check_q8_amx(ops, generator)
    _check_decoder_ops(ops, generator, attention_op=tier == "avx512_vnni")
    _check_stream_read(ops, generator, tier)
    if tier == "avx512_vnni":
        _check_decoder_layer(ops, generator, tier)


def _check_stream_read(ops, generator: torch.Generator, tier: str) -> None:
    """stream_read: the exact sum of the bytes, over whole passes, a tail, and shares of several threads."""
    for size in (1, 255, 4096 + 77, (1 << 17) + 300):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        if ops.stream_read(data, tier) != int(data.sum(dtype=torch.int64)):
            raise Mismatch("its memory read's sum of %d bytes differs from torch's" % size)


def _check_q8_amx(ops, generator: torch.Generator) -> None:
    """q8_amx: one-hot rows give each weight times its block's scale, rounded to bfloat16 as torch rounds
    (exact: one product a result); random rows, with a bias, the exact sum within float32's
    accumulation error and one bfloat16 rounding. 40 rows and 40 outputs: a partial pass and tile."""
    outputs, inputs = 40, 96
    values, scales = quantize_blocks(torch.randn(outputs, inputs, generator=generator), torch.float16)
    tiles = q8_tiles(values, scales)
    weight = (values.float().reshape(outputs, -1, 32) * scales.float()[..., None]).reshape(outputs, inputs).bfloat16()
    if not torch.equal(ops.q8_amx(torch.eye(inputs, dtype=torch.bfloat16), tiles, None, outputs), weight.t()):
        raise Mismatch("its AMX product's weights differ from the reference")
    x = torch.randn(outputs, inputs, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator)
    expected = x.double() @ weight.double().t() + bias.double()
    got = ops.q8_amx(x, tiles, bias, outputs).double()
    slack = 1e-5 * (x.double().abs() @ weight.double().abs().t()) + expected.abs() * 2**-8
    if not torch.all((got - expected).abs() <= slack):
        raise Mismatch("its AMX product differs from the reference by %.3g" % (got - expected).abs().max())


def _check_int4(ops, generator: torch.Generator) -> None:
    group = INT4_GROUP
    for rows, inputs, outputs in ((1, 128, 64), (2, 64, 128), (5, 96, 64)):
        levels, scales, lows = int4_groups(torch.randn(outputs, inputs, generator=generator), group)
        x = torch.randn(rows, inputs, generator=generator)
        blocks, block_scales = quantize_blocks(x)  # the kernel's input rounding
        x_rounded = (blocks.double().reshape(rows, -1, group) * block_scales.double()[..., None]).reshape(rows, inputs)
        scale_w, low_w = scales.bfloat16().double(), lows.bfloat16().double()
        weight = levels.double() * scale_w.repeat_interleave(group, 1) + low_w.repeat_interleave(group, 1)
        expected = x_rounded @ weight.t()
        got = ops.int4_linear(x, int4_blocks(levels, scales, lows)).double()
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())):
            raise Mismatch("its int4 check differs from the reference by %.3g" % (got - expected).abs().max())


def _check_bf16(ops, generator: torch.Generator) -> None:
    """The bfloat16 product against the exact sum of the same bfloat16 values: within the result's
    rounding to bfloat16 and float32's accumulation error."""
    for rows, inputs, outputs, prefetch in ((1, 64, 5, 1), (1, 64, 5, 3), (3, 96, 12, 1), (4, 256, 9, 5)):
        weight = torch.randn(outputs, inputs, generator=generator).bfloat16()
        x = torch.randn(rows, inputs, generator=generator).bfloat16()
        for bias in (None, torch.randn(outputs, generator=generator).bfloat16()):
            expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            got = ops.bf16_linear(x, weight, bias, prefetch).double()
            if not torch.allclose(got, expected, rtol=2**-8, atol=1e-4 * inputs):
                raise Mismatch("its bfloat16 check differs from the reference by %.3g" % (got - expected).abs().max())
    # Prompt attention: two query heads a key head, queries in a transposed view (as the vision tower
    # hands them), a left-padded row whose first queries attend to nothing.
    query = torch.randn(2, 21, 4, 64, generator=generator).bfloat16().transpose(1, 2)
    key, value = (torch.randn(2, 2, 21, 64, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(21, 21, dtype=torch.bool).tril().expand(2, 1, 21, 21).clone()
    mask[1, ..., :5] = False
    expected = reference.prompt_attention(query, key, value, mask, scaling=0.125).float()
    got = ops.prompt_attention(query, key, value, mask, 0.125).float()
    if not torch.allclose(got, expected, rtol=2**-7, atol=1e-3):
        raise Mismatch("its prompt attention check differs from the reference by %.3g" % (got - expected).abs().max())


def _check_decoder_ops(ops, generator: torch.Generator, attention_op: bool) -> None:
    """The norm and rotary ops against the reference's (rotary bit for bit, the norm within
    NORM_TOLERANCE), the attention op against vlserve.model.attention's Python path (within a unit of
    bfloat16: its float32 sums add in another order, which may move a rounding)."""
    for dtype, tolerance in NORM_TOLERANCE.items():
        weight = torch.randn(128, generator=generator).to(dtype)
        x = torch.randn(3, 2, 128, generator=generator).to(dtype)
        expected, got = reference.rms_norm(x, weight, 1e-6).float(), ops.rms_norm(x, weight, 1e-6).float()
        if not torch.all((got - expected).abs() <= expected.abs() * tolerance):
            raise Mismatch("its norm check differs from the reference by %.3g" % (got - expected).abs().max())
        q = torch.randn(2, 3, 4, 64, generator=generator).to(dtype).transpose(1, 2)  # a transposed view, as served
        k = torch.randn(2, 3, 2, 64, generator=generator).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(2, 3, 64, generator=generator).to(dtype) for _ in range(2))
        # Qwen3-VL's rotary embedding (model/network.py's apply_rotary), written out.
        c, s = cos[:, None], sin[:, None]
        expected_q, expected_k = (x * c + torch.cat((-x[..., 32:], x[..., :32]), -1) * s for x in (q, k))
        got_q, got_k = ops.rotary(q, k, cos, sin)
        if not (torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)):
            raise Mismatch("its rotary check differs from the reference's")
    if not attention_op:
        return
    query = torch.randn(2, 1, 4, 32, generator=generator).bfloat16().transpose(1, 2)
    key, value = (torch.randn(2, 2, 9, 32, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :3] = False  # a left-padded sequence
    expected = reference.one_query_attention(query, key, value, mask, scaling=0.2).float()
    got = ops.one_query_attention(query, key, value, mask, 0.2).float()
    if not torch.allclose(got, expected, rtol=2**-7, atol=1e-3):
        raise Mismatch("its attention check differs from the Python path by %.3g" % (got - expected).abs().max())


def _check_decoder_layer(ops, generator: torch.Generator, tier: str) -> None:
    """The decoder layer op against the same layer composed from the checked ops in Python (as
    transformers' Qwen3VLTextDecoderLayer runs a decode step on vlserve's ops): equal bit for bit, its
    output and the key and value it writes. Two rows, two query heads of 32 over one key head; int8
    products (one with a bias), int4 for the MLP's gate and up."""
    rows, width, heads, dim, start, eps, scale = 2, 64, 2, 32, 5, 1e-6, 32**-0.5

    def int8(outputs: int, inputs: int) -> torch.Tensor:
        return q8_tiles(*quantize_blocks(torch.randn(outputs, inputs, generator=generator), torch.float16))

    qkv, o, down = int8((heads + 2) * dim, width), int8(width, heads * dim), int8(width, width)
    gate_up = int4_blocks(*int4_groups(torch.randn(2 * width, width, generator=generator), INT4_GROUP))
    bias = torch.randn((heads + 2) * dim, generator=generator)
    norms = [torch.randn(size, generator=generator).bfloat16() for size in (width, width, dim, dim)]
    hidden = torch.randn(rows, 1, width, generator=generator).bfloat16()
    cos, sin = (torch.randn(rows, 1, dim, generator=generator).bfloat16() for _ in range(2))
    keys, values = (torch.randn(rows, 1, 8, dim, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(rows, 1, 1, start + 1, dtype=torch.bool)
    mask[1, ..., :2] = False

    x = ops.rms_norm(hidden, norms[0], eps).reshape(rows, width)
    q, k, v = ops.q8_linear(x, qkv, bias, (heads + 2) * dim, tier).split([heads * dim, dim, dim], -1)
    q = ops.rms_norm(q.contiguous().view(rows, 1, heads, dim), norms[2], eps).transpose(1, 2)
    k = ops.rms_norm(k.contiguous().view(rows, 1, 1, dim), norms[3], eps).transpose(1, 2)
    q, k = ops.rotary(q, k, cos, sin)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[:, :, start] = k[:, :, 0]
    expected_values[:, :, start] = v.view(rows, 1, dim)
    a = ops.one_query_attention(q, expected_keys[:, :, : start + 1], expected_values[:, :, : start + 1], mask, scale)
    h = hidden + ops.q8_linear(a.reshape(rows, -1), o, None, width, tier).view(rows, 1, width)
    g, u = ops.int4_linear(ops.rms_norm(h, norms[1], eps).reshape(rows, width), gate_up).split(width, -1)
    up = torch.nn.functional.silu(g.contiguous()) * u.contiguous()
    expected = h + ops.q8_linear(up, down, None, width, tier).view(rows, 1, width)

    product = torch.classes.vlserve.Product
    products = [
        product(kind, [weight], extra, outputs, None, None, None, None, None)
        for kind, weight, extra, outputs in (
            (1, qkv, bias, (heads + 2) * dim),
            (1, o, None, width),
            (2, gate_up, None, 2 * width),
            (1, down, None, width),
        )
    ]
    layer = torch.classes.vlserve.DecoderLayer(*norms, eps, *products, heads, 1, dim, width, scale, 1, tier)
    got = layer.decode(hidden, cos, sin, keys, values, start, mask)
    if not (torch.equal(got, expected) and torch.equal(keys, expected_keys) and torch.equal(values, expected_values)):
        raise Mismatch("its decoder layer check differs from the same ops composed in Python")


# What each tier's library serves, as /readyz and /status say it.
