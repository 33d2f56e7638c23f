"""The quantized weights' layouts, as vlserve's kernels read them: pure tensor code, no kernel state.

Q8_0 (int8): symmetric, one scale per block of 32 inputs, as llama.cpp's Q8_0; `q8_tiles` lays it out
for kernels/q8.cpp. int4: asymmetric levels 0..15 per group of 32 with a scale and a low value;
`int4_blocks` lays it out for kernels/decode_vnni.cpp. The kernels' binding (native.py) checks a
build against these layouts, and the quantized layers (quantized.py) store their weights in them.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
Q8_BLOCK = 32  # inputs per scale of the int8 format, weights and inputs alike (q8.cpp)
Q8_TILE = 16  # outputs per tile of its kernel's layout
Q8_STEP = 8 * 64 + Q8_TILE * 2  # bytes per tile and block: eight lines of weights, sixteen fp16 scales
INT4_GROUP = 32
INT4_LEVELS = 15
INT4_ROW_BLOCK = 16  # torch's int4 kernel holds outputs in blocks of 16
INT4_BLOCK_ROWS = 64  # vlserve's, in blocks of 64 (one stream of bytes per 64 outputs)


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (values, float32 scales) with matrix ~= values * scales[:, None]."""
    wide = matrix.float()
    scales = (wide.abs().amax(dim=1) / INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    values = (wide / scales[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


def quantize_blocks(matrix: torch.Tensor, scale_dtype: torch.dtype = torch.float32):
    """Symmetric int8 per block of Q8_BLOCK along each row, as kernels/q8.cpp rounds inputs (float32
    scales) and llama.cpp's Q8_0 weights (fp16 scales): (values (rows, in), scales (rows, in / 32))
    with matrix ~= values * scales per block. A block whose step is 0 in `scale_dtype` is all zeros."""
    rows, columns = matrix.shape
    blocks = matrix.float().reshape(rows, columns // Q8_BLOCK, Q8_BLOCK)
    scales = (blocks.abs().amax(dim=-1) / INT8_MAX).to(scale_dtype)
    step = scales.float()[..., None]
    values = torch.where(step > 0, blocks / step, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values.reshape(rows, columns), scales


def q8_tiles(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q8_0 values (out, in) int8 and fp16 scales (out, in / 32) -> kernels/q8.cpp's layout, uint8 of
    shape (ceil(out / 16), in / 32 * 544): per tile of 16 outputs and block of 32 inputs, eight 64-byte
    lines whose byte 4o + i of line l holds output o's input 4l + i plus 128, then the 16 fp16 scales.
    Outputs past `out` (to a multiple of 16) are zero weights."""
    outputs, columns = values.shape
    tiles, blocks = -(-outputs // Q8_TILE), columns // Q8_BLOCK
    padding = tiles * Q8_TILE - outputs
    shifted = (values.to(torch.int16) + 128).to(torch.uint8)
    if padding:
        shifted = torch.cat([shifted, torch.full((padding, columns), 128, dtype=torch.uint8)])
        scales = torch.cat([scales, scales.new_zeros(padding, blocks)])
    lines = shifted.reshape(tiles, Q8_TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 512)
    scale_bytes = scales.to(torch.float16).reshape(tiles, Q8_TILE, blocks).transpose(1, 2).contiguous()
    return torch.cat([lines, scale_bytes.view(torch.uint8)], dim=2).reshape(tiles, blocks * Q8_STEP).contiguous()


def q8_untiled(tiles: torch.Tensor, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`q8_tiles`' inverse: (values (out, in) int8, fp16 scales (out, in / 32))."""
    count, width = tiles.shape
    blocks = width // Q8_STEP
    parts = tiles.reshape(count, blocks, Q8_STEP)
    lines = parts[..., :512].reshape(count, blocks, 8, Q8_TILE, 4).permute(0, 3, 1, 2, 4)
    values = (lines.reshape(count * Q8_TILE, blocks * Q8_BLOCK).to(torch.int16) - 128).to(torch.int8)
    scales = parts[..., 512:].contiguous().view(torch.float16).transpose(1, 2).reshape(count * Q8_TILE, blocks)
    return values[:outputs], scales[:outputs]


def int4_groups(matrix: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group` inputs: (levels 0..15 as int32, scales, lows) with
    weight ~= level * scale + low (torch's kernels take zero = low + 8 * scale instead)."""
    rows, columns = matrix.shape
    grouped = matrix.float().reshape(rows, columns // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / INT4_LEVELS).clamp_(min=torch.finfo(torch.float32).tiny)
    levels = ((grouped - low[..., None]) / scales[..., None]).round_().clamp_(0, INT4_LEVELS)
    return levels.to(torch.int32).reshape(rows, columns), scales, low


def int4_blocks(levels: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """Levels (out, in) 0..15 with scales and lows (out, in / 32) -> vlserve's int4 kernel's layout
    (kernels/decode_vnni.cpp), (out / 64, in / 32 * 1280) bytes: per 64 outputs and group of 32 inputs,
    four tiles of 16 outputs, each four 64-byte lines whose byte j holds output j // 4's inputs
    8l + j % 4 (low nibble) and 8l + 4 + j % 4 (high nibble); then per tile and output a 32-bit word,
    its bfloat16 scale in the low half and its bfloat16 low value in the high half."""
    rows, columns = levels.shape
    blocks, groups = rows // INT4_BLOCK_ROWS, columns // INT4_GROUP
    tiles = INT4_BLOCK_ROWS // INT4_ROW_BLOCK
    split = levels.to(torch.uint8).reshape(blocks, tiles, INT4_ROW_BLOCK, groups, 4, 2, 4)
    split = split.permute(0, 3, 1, 4, 2, 6, 5)  # block, group, tile, line, output, input % 4, nibble
    nibbles = (split[..., 0] | (split[..., 1] << 4)).reshape(blocks, groups, tiles * INT4_GROUP * INT4_ROW_BLOCK // 2)

    def bits(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF

    words = (bits(scales) | (bits(lows) << 16)).reshape(blocks, tiles * INT4_ROW_BLOCK, groups).transpose(1, 2)
    params = words.contiguous().view(torch.uint8)  # (blocks, groups, 4 * 64) little-endian words
    return torch.cat([nibbles, params], dim=2).reshape(blocks, -1).contiguous()
