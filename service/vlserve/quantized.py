"""Quantized weights: int8 (per output channel, dynamic int8 inputs) and int4 (groups of 32).

The sizing policy's `quantize` level picks them (docs/service.md says what each level rounds):

- int8: every linear layer of the language model and the output head is stored as int8, one
  float32 scale per output channel; each input row (a token, a patch) is rounded to int8 with its
  own scale at every call, and the integer product is exact (the usual W8A8 dynamic scheme of
  torch's `quantize_dynamic` and OpenVINO's CPU plugin). The products are oneDNN's prepacked int8
  kernels (`torch.ops.onednn.qlinear_*`, the ones torch's own x86 quantization lowers to): a
  decode step reads half the bytes of bfloat16, and prompts and images, which are compute-bound,
  run on VNNI's int8 rate. Where those kernels are missing (a torch build without oneDNN, Arm),
  `torch._weight_int8pack_mm` multiplies the same weights with exact inputs. Where vlserve's own
  kernels run (native.py: AVX-512 VNNI and a compiler), decode rows go through them, twice as fast,
  with the same result, and the weights keep their plain layout: prompts and images multiply it
  through `torch._int_mm`, measured as fast as the prepacked kernel from 64 rows up (2048x6144 and
  6144x2048, 256 rows: 50-73 ms against 49-53 ms for eight products; 1024 rows: 281-325 against
  284-290 ms), and the weights stay in the weight cache's file, shared by the host's workers.
- int4: the decoder's linear layers in 4 bits, groups of 32 weights along the input sharing a
  scale and a zero point (min/max, as llama.cpp's Q4_1 blocks of 32), through torch's
  `_weight_int4pack_mm_for_cpu`; the output head stays int8 (as llama.cpp's Q4_K_M keeps it wider):
  measured on the real-size head (151936x2048, one row), int4 4.55 ms against int8 4.70 ms, no
  faster, and 40x the KL divergence of its logits (0.0025 against 0.00006 nats on random rows).
  That kernel dequantizes on the fly and is slow on many rows, so prompts may use an int8 copy.
  Where vlserve's own kernels run, int4 weights take their block layout and multiply there instead.

Measured with torch 2.13 at 2 threads, forty 6144x2048 products (a working set beyond the cache),
one row, in one process: packed bfloat16 14.3 ms, int8 10.8 ms, int4 7.5 ms (groups of 32) and
7.1 ms (128); at 64 rows (eight products) packed bfloat16 14.5 ms, oneDNN int8 8.1 ms, int4 36.4 ms.
Groups of 32 cost 0.125 bytes per weight in scales (128: 0.03) for about the same speed, and each
group's range, so its rounding step, is narrower: 32, as llama.cpp's blocks.
"""

from __future__ import annotations

import functools

import torch

from vlserve import native

INT8_MAX = 127
INT8_PREFILL_ROWS = 16  # int8 overtakes the packed bf16 product from ~8 rows (2048x6144: 1.4 vs 2.4 ms at 16)
INT4_GROUP = 32
INT4_LEVELS = 15
INT4_ROW_BLOCK = 16  # torch's int4 kernel holds outputs in blocks of 16
INT4_BLOCK_ROWS = 64  # vlserve's, in blocks of 64 (one stream of bytes per 64 outputs)
QUANTIZE_CHUNK_ROWS = 4096  # rows quantized at a time: the output head's float32 temporaries stay ~32 MB


@functools.cache
def onednn_int8_supported() -> bool:
    """Whether this torch build has oneDNN's prepacked int8 products for this CPU (x86)."""
    try:
        _onednn_product(_onednn_pack(torch.ones(8, 32, dtype=torch.int8)), torch.ones(1, 32), torch.ones(8), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def int8_products_supported() -> bool:
    """Whether int8 inputs times int8 weights run here (the int8 vision tower and prompt copies need them)."""
    return onednn_int8_supported()


@functools.cache
def int4_supported() -> bool:
    """Whether this torch build has the int4 CPU kernels (`_weight_int4pack_mm_for_cpu`)."""
    try:
        Int4Weight(torch.ones(INT4_ROW_BLOCK, INT4_GROUP)).matmul(torch.ones(1, INT4_GROUP))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def whole(weight: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A fused group's weight (packing.PackedGroup hands over its members' parts) as one matrix."""
    return torch.cat(weight) if isinstance(weight, list) else weight


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (values, float32 scales) with matrix ~= values * scales[:, None]."""
    wide = matrix.float()
    scales = (wide.abs().amax(dim=1) / INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    values = (wide / scales[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


def _in_chunks(matrix: torch.Tensor, quantize) -> tuple[torch.Tensor, ...]:
    """`quantize` on QUANTIZE_CHUNK_ROWS rows at a time, results concatenated."""
    parts = [
        quantize(matrix[start : start + QUANTIZE_CHUNK_ROWS])
        for start in range(0, matrix.shape[0], QUANTIZE_CHUNK_ROWS)
    ]
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def _onednn_pack(values: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(values, [1, values.shape[1]])


def shifted_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(rows)` with its values shifted by 128 into uint8 (what oneDNN's u8s8 kernels take),
    in fewer operations: a decode step rounds four inputs per layer, and each operation costs
    microseconds of dispatch beside a one-row product's ~0.1 ms."""
    wide = rows.float()
    scales = (
        torch.linalg.vector_norm(wide, float("inf"), dim=1).div_(INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    )
    return (wide / scales[:, None]).round_().add_(128).clamp_(1, 255).to(torch.uint8), scales


@functools.cache
def _zero_points(outputs: int) -> torch.Tensor:
    return torch.zeros(outputs, dtype=torch.long)


def _onednn_product(packed: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """rows (n, in) float -> (n, out) float32: inputs to int8 per row, shifted to uint8 with zero point 128
    (oneDNN's u8s8 kernels), the int32 sums rescaled by the weight's scales, then by each row's."""
    shifted, row_scales = shifted_rows(rows)
    out = torch.ops.onednn.qlinear_pointwise(
        shifted, 1.0, 128, packed, scales, _zero_points(scales.shape[0]), None, 1.0, 0, torch.float32, "none", [], ""
    )
    out.mul_(row_scales[:, None])
    if bias is not None:
        out.add_(bias)
    return out


class Int8Weight:
    """A linear layer's weight (and bias) as int8 per output channel; `matmul` rounds its inputs per row.

    Built with `prepack=False` (or from the weight cache, `from_tensors`) it keeps its plain int8 values
    and multiplies them through `torch._int_mm` (oneDNN's matmul on a plain layout: measured 1.3x the
    prepacked kernel's time for one row, 2x for 2-8) until `finish_layout` reorders them into oneDNN's
    prepacked layout: that reorder runs at about 0.6 GB/s here (2.3 s for the language model), so the
    loader leaves it to the worker's after-ready steps instead of making starts wait for it."""

    dtype = torch.int8

    def __init__(
        self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None, *, prepack: bool = True
    ):
        values, scales = _in_chunks(whole(weight).detach(), quantize_rows)  # (out, in) int8, (out,) float32
        self._hold(values, scales, None if bias is None else bias.detach().float())
        if prepack:
            self.finish_layout()

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Int8Weight:
        """The weight whose `tensors()` these are (mapped from the weight cache: not copied)."""
        weight = cls.__new__(cls)
        weight._hold(tensors["values"], tensors["scales"], tensors.get("bias"))
        return weight

    def _hold(self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.values, self.scales, self.bias, self.packed = values, scales, bias, None
        self.shape = tuple(values.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Plain tensors that rebuild this weight (before `finish_layout`: oneDNN's layout is opaque)."""
        if self.values is None:
            raise ValueError("a prepacked int8 weight no longer holds its plain values")
        return {"values": self.values, "scales": self.scales, **({} if self.bias is None else {"bias": self.bias})}

    @property
    def layout_pending(self) -> bool:
        """Whether `finish_layout` would reorder: not where vlserve's own kernel runs, since it reads the
        plain layout, and `torch._int_mm` on it matched the prepacked kernel from 64 rows (native.py)."""
        return self.packed is None and onednn_int8_supported() and native.int8_linear() is None

    def finish_layout(self) -> None:
        """Reorder into oneDNN's prepacked layout, where this CPU has it, and let go of the plain values."""
        if self.layout_pending:
            self.packed, self.values = _onednn_pack(self.values), None

    @property
    def nbytes(self) -> int:
        stored = self.packed if self.packed is not None else self.values
        return stored.nbytes + self.scales.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, in) of any float dtype -> (n, out) float32 (vlserve's kernel: the rows' dtype)."""
        if self.packed is not None:
            return _onednn_product(self.packed, rows, self.scales, self.bias)
        kernel = native.int8_linear()
        if kernel is not None and rows.shape[0] <= native.MAX_ROWS and self.shape[1] % native.INPUT_MULTIPLE == 0:
            return kernel(rows, self.values, self.scales, self.bias)  # the path below's result, bit for bit
        if onednn_int8_supported():  # the same integer product, on the plain layout
            values, row_scales = quantize_rows(rows)
            out = torch._int_mm(values, self.values.t()).float().mul_(row_scales[:, None]).mul_(self.scales)
        else:
            out = torch._weight_int8pack_mm(rows.float(), self.values, self.scales)  # exact inputs, any CPU
        return out if self.bias is None else out.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this one stands for (tests); a packed one is read back through products
        with the identity, whose rows quantize exactly."""
        if self.packed is None:
            return self.values.float() * self.scales[:, None]
        return _onednn_product(self.packed, torch.eye(self.shape[1]), self.scales, None).t().contiguous()


def _int4_groups(matrix: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class Int4Weight:
    """A linear layer's weight as 4-bit levels in groups of `group` inputs, in its kernel's layout:
    vlserve's own (`tiled`, native.py: groups of 32, outputs a multiple of 64) where it runs, else
    torch's `_weight_int4pack_mm_for_cpu`.

    torch's kernel is fed bfloat16 whatever the model's dtype: its float32 path is far slower (9.3 ms
    per 6144x2048 product against 0.19 ms with AVX-512 and 0.64 ms held to AVX2), and rounding inputs
    to bfloat16 is small beside rounding weights to 4 bits. vlserve's rounds them to int8 per block
    of 32 (twice the stock kernel's error on random data: 0.57% against 0.29%) and reads the weights
    as integers: one decode step's int4 products about twice as fast here (docs/benchmarks.md)."""

    dtype = torch.quint4x2
    kernel_dtype = torch.bfloat16

    def __init__(
        self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None, *, group: int = INT4_GROUP
    ):
        weight = whole(weight)
        rows, columns = weight.shape
        if columns % group or rows % INT4_ROW_BLOCK:
            raise ValueError(
                "int4 needs inputs in groups of %d and outputs in blocks of %d, not a %dx%d weight"
                % (group, INT4_ROW_BLOCK, rows, columns)
            )
        levels, scales, lows = _in_chunks(weight.detach(), functools.partial(_int4_groups, group=group))
        self.shape, self.group = (rows, columns), group
        self.tiled = group == INT4_GROUP and rows % INT4_BLOCK_ROWS == 0 and native.int4_linear() is not None
        if self.tiled:
            self.packed, self.scales_and_zeros = int4_blocks(levels, scales, lows), None
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(levels, 1)  # (out, in / 2) uint8
            # (groups, out, 2), as the kernel wants them.
            zeros = lows + 8 * scales
            self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(self.kernel_dtype).contiguous()
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        """The weight whose `tensors()` these are (mapped from the weight cache: not copied)."""
        weight = cls.__new__(cls)
        weight.tiled = "blocks" in tensors
        weight.bias = tensors.get("bias")
        if weight.tiled:
            weight.packed, weight.scales_and_zeros = tensors["blocks"], None
            blocks, width = weight.packed.shape
            group_bytes = INT4_BLOCK_ROWS * (INT4_GROUP // 2 + 4)  # levels, then a (scale, low) word per output
            weight.shape, weight.group = (blocks * INT4_BLOCK_ROWS, width // group_bytes * INT4_GROUP), INT4_GROUP
        else:
            weight.packed, weight.scales_and_zeros = tensors["packed"], tensors["scales_and_zeros"]
            rows, half = weight.packed.shape
            weight.shape, weight.group = (rows, 2 * half), 2 * half // weight.scales_and_zeros.shape[0]
        return weight

    def tensors(self) -> dict[str, torch.Tensor]:
        """Plain tensors that rebuild this weight (both kernels' layouts are plain uint8: nothing to redo)."""
        found = (
            {"blocks": self.packed}
            if self.tiled
            else {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}
        )
        return found if self.bias is None else {**found, "bias": self.bias}

    @property
    def nbytes(self) -> int:
        extra = [tensor for tensor in (self.scales_and_zeros, self.bias) if tensor is not None]
        return self.packed.nbytes + sum(tensor.nbytes for tensor in extra)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, in) of any float dtype -> (n, out) in bfloat16 (torch's kernel), the rows' dtype
        (vlserve's) or float32 (with a bias): the caller converts to its own dtype, so a bfloat16 model
        makes no round trip through float32."""
        if self.bias is None:
            return self._product(rows)
        return self._product(rows.float()).float().add_(self.bias)  # added before any rounding to bfloat16

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            kernel = native.int4_linear()
            if kernel is None:  # the weight cache keys its int4 files by layout: not reached in a worker
                raise RuntimeError("an int4 weight in vlserve's layout, but its kernel is not loaded")
            return kernel(rows, self.packed)
        return torch._weight_int4pack_mm_for_cpu(
            rows.to(self.kernel_dtype), self.packed, self.group, self.scales_and_zeros
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this one stands for, read back through a product with the identity (whose
        rows each kernel takes exactly; vlserve's returns them in float32)."""
        eye = torch.eye(self.shape[1], dtype=torch.float32 if self.tiled else self.kernel_dtype)
        return self._product(eye).float().t().contiguous()


class Int8Linear(torch.nn.Module):
    """`nn.Linear` through `Int8Weight`; returns the input's dtype."""

    def __init__(self, in_features: int, out_features: int, weight: Int8Weight):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_int8 = weight

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, prepack: bool = True) -> Int8Linear:
        return cls(linear.in_features, linear.out_features, Int8Weight(linear.weight, linear.bias, prepack=prepack))

    @property
    def stored(self) -> Int8Weight:
        return self.weight_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_int8.matmul(x.reshape(-1, self.in_features))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return "in_features=%d, out_features=%d, bias=%s, int8=dynamic" % (
            self.in_features,
            self.out_features,
            self.weight_int8.bias is not None,
        )


def quantize_vision_tower(
    visual: torch.nn.Module, prepared=None, prefix: str = "visual", *, prepack: bool = True
) -> int:
    """Every linear layer of the vision tower to `Int8Linear`, the rest (norms, patch embedding) to
    float32; returns how many layers were quantized. Quantizing first spares a float32 copy of them.
    `prepared` (a weightcache.PreparedWeights): weights taken from the cache, or kept for it, by name
    under `prefix`; `prepack=False` leaves oneDNN's layout to packing.layout_steps."""
    count = 0
    for parent_name, parent in list(visual.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                full = ".".join(part for part in (prefix, parent_name, name) if part)
                make = functools.partial(Int8Weight, child.weight, child.bias, prepack=prepack)
                shape = tuple(child.weight.shape)
                weight = make() if prepared is None else prepared.weight(full, Int8Weight, make, shape)
                layer = Int8Linear(child.in_features, child.out_features, weight)
                setattr(parent, name, layer)
                count += 1
    visual.to(torch.float32)
    return count


class PromptInt8Linear(torch.nn.Module):
    """A plain `nn.Linear` (float32 models: CPUs with VNNI but no BF16) whose prompt-sized products go
    through an int8 copy of its weight once `make_prefill_copy` has made it; decode steps keep the
    original. The same copy protocol as `PackedLinear`, so the engine makes both kinds after ready."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.prefill_weight: Int8Weight | None = None
        self.prefill_copy_pending = True

    def make_prefill_copy(self) -> None:
        self.prefill_weight = Int8Weight(self.linear.weight, self.linear.bias)
        self.prefill_copy_pending = False

    def drop_prefill_source(self) -> None:
        self.prefill_copy_pending = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.prefill_weight is None or rows.shape[0] < INT8_PREFILL_ROWS:
            return self.linear(x)
        return self.prefill_weight.matmul(rows).to(x.dtype).view(*x.shape[:-1], self.out_features)


def add_int8_prompt_copies(text_model: torch.nn.Module) -> int:
    """Wrap every linear layer of an unpacked text decoder in `PromptInt8Linear`; returns how many."""
    count = 0
    for parent in list(text_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PromptInt8Linear(child))
                count += 1
    return count
