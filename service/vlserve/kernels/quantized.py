"""Quantized weights: int8 (llama.cpp's Q8_0: a scale per block of 32 inputs) and int4 (groups of 32).

The sizing policy's `quantize` level picks them (docs/quantization.md says what each level rounds and
what it costs):

- int8: every linear layer of the language model and the output head is stored as int8 values with
  an fp16 scale per output and block of 32 inputs; every input row is rounded the same way at each
  call (a scale per block of 32), and the integer sums are exact. That is llama.cpp's Q8_0 x Q8_0.
  One scale per row (the W8A8 dynamic scheme of torch's `quantize_dynamic` that this level used
  before) let a single large channel coarsen the whole row: on a checkpoint whose inputs have four
  channels 40 times larger than the rest (as trained models have), next-token agreement fell from
  84% to 25%; per block the large channel coarsens its own 32 inputs only. vlserve's kernels
  (native.py, kernels/q8.cpp) multiply these weights on AVX-512 VNNI and on AVX2 with equal
  results, one row or thousands, at about the memory's speed for decode steps. Where they cannot
  run, the weights keep one scale per output row and torch's weight-only product
  (`torch._weight_int8pack_mm`) multiplies exact inputs: correct everywhere, slower on prompts.
  oneDNN's int8 kernels are not used: on CPUs without VNNI their 16-bit pair sums saturate.
- int4: the decoder's linear layers in 4 bits, groups of 32 weights along the input sharing a
  scale and a zero point (min/max, as llama.cpp's Q4_1 blocks of 32), through vlserve's int4 kernel
  (AVX-512 VNNI: inputs rounded per block of 32 as above) or torch's `_weight_int4pack_mm_for_cpu`
  (bfloat16 inputs); the output head stays int8 (as llama.cpp's Q4_K_M keeps it wider): measured on
  the real-size head (151936x2048, one row), int4 4.55 ms against int8 4.70 ms, no faster, and 40x
  the KL divergence of its logits. Prompts run through an int8 copy of the layers where vlserve's
  int8 product runs, for accuracy: on the real-size checkpoint int4 prompts doubled the answers' KL
  divergence (0.070 against 0.039 nats, docs/quantization.md) while the int4 product's prompt path is
  only 1.17x slower than int8's. The copies are Q8_0 weights like the int8 level's, kept in the
  weight cache file with the int4 ones and mapped at load.

A few channels of a residual stream can be far larger than the rest in trained models; the layers
around them keep those channels exact (vlserve/model/outliers.py): an `ExactChannels` weight wraps the
rounded one.

Measured with torch 2.13 at 2 threads, forty 6144x2048 products (a working set beyond the cache),
one row, in one process: packed bfloat16 14.3 ms, int8 10.8 ms, int4 7.5 ms (groups of 32) and
7.1 ms (128); at 64 rows (eight products) packed bfloat16 14.5 ms, oneDNN int8 8.1 ms, int4 36.4 ms.
Groups of 32 cost 0.125 bytes per weight in scales (128: 0.03) for about the same speed, and each
group's range, so its rounding step, is narrower: 32, as llama.cpp's blocks.
"""

from __future__ import annotations

import functools

import torch

from vlserve.kernels import native
from vlserve.kernels.formats import (
    INT4_BLOCK_ROWS,
    INT4_GROUP,
    INT4_ROW_BLOCK,
    Q8_BLOCK,
    Q8_STEP,
    int4_blocks,
    int4_groups,
    q8_tiles,
    q8_untiled,
    quantize_blocks,
    quantize_rows,
)

INT8_PREFILL_ROWS = 16  # int8 overtakes the packed bf16 product from ~8 rows (2048x6144: 1.4 vs 2.4 ms at 16)
QUANTIZE_CHUNK_ROWS = 4096  # rows quantized at a time: the output head's float32 temporaries stay ~32 MB


def int8_products_supported(kernels: native.Kernels) -> bool:
    """Whether int8 inputs times int8 weights run fast on `kernels` (vlserve's int8 product: AVX-512
    VNNI or AVX2): the int8 vision tower and prompt copies need it; without it they would run torch's
    weight-only product on float inputs, no faster than float32."""
    return kernels.q8_linear() is not None


class KernelBound:
    """A weight format whose products run on one process's kernels: `Format.on(kernels)` is the
    format bound to them (a subclass, made once per pair, so isinstance still sees the format); the
    unbound class runs torch's. The loader binds every format it hands out."""

    kernels: native.Kernels = native.STOCK_KERNELS

    @classmethod
    def on(cls, kernels: native.Kernels) -> type:
        if cls.kernels is kernels:
            return cls
        return _bound(cls.__base__ if "kernels" in vars(cls) else cls, kernels)  # from the format itself


@functools.cache
def _bound(cls: type, kernels: native.Kernels) -> type:
    return type(cls.__name__, (cls,), {"kernels": kernels, "__module__": cls.__module__})


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


def _in_chunks(matrix: torch.Tensor, quantize) -> tuple[torch.Tensor, ...]:
    """`quantize` on QUANTIZE_CHUNK_ROWS rows at a time, results concatenated."""
    parts = [
        quantize(matrix[start : start + QUANTIZE_CHUNK_ROWS])
        for start in range(0, matrix.shape[0], QUANTIZE_CHUNK_ROWS)
    ]
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))


def _q8_tiles_of(matrix: torch.Tensor) -> tuple[torch.Tensor]:
    return (q8_tiles(*quantize_blocks(matrix, torch.float16)),)


def _amx_rows(rows: torch.Tensor) -> bool:
    """Whether an int8 product of `rows` goes to AMX's tiles where the CPU has AMX."""
    return rows.dtype == torch.bfloat16 and rows.shape[0] >= native.AMX_PROMPT_ROWS


class Int8Weight(KernelBound):
    """A linear layer's weight (and bias) in int8. Where vlserve's int8 product runs (kernels.q8_linear),
    Q8_0 in its tiles (`tiles`), multiplied there with inputs rounded per block of 32; elsewhere one
    scale per output row (`values`, `scales`), multiplied by torch's weight-only product with exact
    inputs. The weight cache keeps the two layouts in separate files."""

    dtype = torch.int8

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None):
        weight = whole(weight).detach()
        self.bias = None if bias is None else bias.detach().float()
        self.shape = tuple(weight.shape)
        if self.kernels.q8_linear() is not None and self.shape[1] % Q8_BLOCK == 0:
            (self.tiles,) = _in_chunks(weight, _q8_tiles_of)  # QUANTIZE_CHUNK_ROWS is a multiple of 16
            self.values = self.scales = None
        else:
            self.tiles = None
            self.values, self.scales = _in_chunks(weight, quantize_rows)  # (out, in) int8, (out,) float32

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Int8Weight:
        """The weight whose `tensors()` these are (mapped from the weight cache: not copied)."""
        weight = cls.__new__(cls)
        weight.bias = tensors.get("bias")
        if "tiles" in tensors:
            weight.tiles, weight.values, weight.scales = tensors["tiles"], None, None
            outputs = int(tensors["outputs"][0])
            weight.shape = (outputs, weight.tiles.shape[1] // Q8_STEP * Q8_BLOCK)
        else:
            weight.tiles, weight.values, weight.scales = None, tensors["values"], tensors["scales"]
            weight.shape = tuple(weight.values.shape)
        return weight

    def tensors(self) -> dict[str, torch.Tensor]:
        """Plain tensors that rebuild this weight."""
        if self.tiles is not None:
            found = {"tiles": self.tiles, "outputs": torch.tensor([self.shape[0]], dtype=torch.int64)}
        else:
            found = {"values": self.values, "scales": self.scales}
        return found if self.bias is None else {**found, "bias": self.bias}

    @property
    def nbytes(self) -> int:
        stored = [self.tiles] if self.tiles is not None else [self.values, self.scales]
        return sum(t.nbytes for t in stored) + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, in) of any float dtype -> (n, out): the rows' dtype (vlserve's kernel) or float32."""
        on_amx = self.kernels.q8_amx()
        if self.tiles is not None and on_amx is not None and _amx_rows(rows):
            # Many rows on AMX: its bfloat16 tiles outrun vpdpbusd, on the rows unrounded (native.AMX_PROMPT_ROWS).
            return on_amx(rows, self.tiles, self.bias, self.shape[0])
        if self.tiles is not None:
            kernel = self.kernels.q8_linear()
            if kernel is None:  # the weight cache keys its int8 files by layout: not reached in a worker
                raise RuntimeError("an int8 weight in vlserve's layout, but its kernel is not loaded")
            return kernel(rows if rows.dtype == torch.bfloat16 else rows.float(), self.tiles, self.bias, self.shape[0])
        out = torch._weight_int8pack_mm(rows.float(), self.values, self.scales)  # exact inputs, any CPU
        return out if self.bias is None else out.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this one stands for (tests)."""
        if self.tiles is None:
            return self.values.float() * self.scales[:, None]
        values, scales = q8_untiled(self.tiles, self.shape[0])
        return (values.float().reshape(self.shape[0], -1, Q8_BLOCK) * scales.float()[..., None]).reshape(self.shape)


class Int4Weight(KernelBound):
    """A linear layer's weight as 4-bit levels in groups of `group` inputs, in its kernel's layout:
    vlserve's own (`tiled`, native.py: groups of 32, outputs a multiple of 64) where it runs, else
    torch's `_weight_int4pack_mm_for_cpu`.

    torch's kernel is fed bfloat16 whatever the model's dtype: its float32 path is far slower (9.3 ms
    per 6144x2048 product against 0.19 ms with AVX-512 and 0.64 ms held to AVX2), and rounding inputs
    to bfloat16 is small beside rounding weights to 4 bits. vlserve's rounds them to int8 per block
    of 32 (twice the stock kernel's error on random data: 0.57% against 0.29%) and reads the weights
    as integers: one decode step's int4 products about twice as fast here (docs/benchmark-history.md)."""

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
        levels, scales, lows = _in_chunks(weight.detach(), functools.partial(int4_groups, group=group))
        self.shape, self.group = (rows, columns), group
        self.tiled = group == INT4_GROUP and rows % INT4_BLOCK_ROWS == 0 and self.kernels.int4_linear() is not None
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
            kernel = self.kernels.int4_linear()
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


class ExactChannels:
    """A rounded weight (`Int8Weight`, `Int4Weight`) with a few channels kept as the checkpoint has them
    (vlserve/model/outliers.py says which and why): input `columns`, whose weights are kept in float32 and
    whose inputs leave the rounded product (zeroed there) to be multiplied apart; output `rows`, whose
    results come from the checkpoint's weights. The rounded weight holds zeros in those places, so its
    scales are those of the rest."""

    def __init__(self, inner, *, columns=None, column_weights=None, rows=None, row_weights=None, row_bias=None):
        self.inner = inner
        self.columns, self.column_weights = columns, column_weights
        self.rows, self.row_weights, self.row_bias = rows, row_weights, row_bias
        self.shape, self.dtype = inner.shape, inner.dtype

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], inner_format) -> ExactChannels:
        extra = ("columns", "column_weights", "rows", "row_weights", "row_bias")
        inner = inner_format.from_tensors({k: v for k, v in tensors.items() if k not in extra})
        return cls(inner, **{name: tensors.get(name) for name in extra})

    def tensors(self) -> dict[str, torch.Tensor]:
        extra = {
            "columns": self.columns,
            "column_weights": self.column_weights,
            "rows": self.rows,
            "row_weights": self.row_weights,
            "row_bias": self.row_bias,
        }
        return {**self.inner.tensors(), **{name: t for name, t in extra.items() if t is not None}}

    @property
    def nbytes(self) -> int:
        extra = (self.column_weights, self.row_weights, self.row_bias)
        return self.inner.nbytes + sum(t.nbytes for t in extra if t is not None)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """As the inner weight's product, in float32 where a channel is kept exact."""
        if self.columns is None:
            out = self.inner.matmul(rows)
        else:
            apart = rows.index_select(1, self.columns).float() @ self.column_weights.t()
            out = self.inner.matmul(rows.index_fill(1, self.columns, 0)).float().add_(apart)
        if self.rows is not None:
            exact = (
                torch.addmm(self.row_bias, rows.float(), self.row_weights.t())
                if self.row_bias is not None
                else (rows.float() @ self.row_weights.t())
            )
            out = out.float().index_copy_(1, self.rows, exact)
        return out

    def dequantized(self) -> torch.Tensor:
        weight = self.inner.dequantized().clone()
        if self.columns is not None:
            weight[:, self.columns] = self.column_weights
        if self.rows is not None:
            weight[self.rows] = self.row_weights
        return weight


class ExactFormat:
    """A weight format (`Int8Weight`, `Int4Weight`) whose weights keep `columns` and `rows` exact: called
    as the format is, `(weight, bias)`, and read back from the weight cache with `from_tensors`."""

    def __init__(self, inner_format, columns: list[int] | None = None, rows: list[int] | None = None):
        self.inner_format = inner_format
        self.columns = torch.tensor(columns, dtype=torch.long) if columns else None
        self.rows = torch.tensor(rows, dtype=torch.long) if rows else None
        self.dtype = inner_format.dtype

    def __call__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None):
        if self.columns is None and self.rows is None:
            return self.inner_format(weight, bias)
        full = whole(weight).detach().float()
        rest = full.clone()
        column_weights = row_weights = row_bias = None
        if self.columns is not None:
            column_weights = full[:, self.columns].contiguous()
            rest[:, self.columns] = 0
        if self.rows is not None:
            row_weights = full[self.rows].contiguous()
            row_bias = None if bias is None else bias.detach().float()[self.rows].contiguous()
            rest[self.rows] = 0
        inner = self.inner_format(rest, bias)
        return ExactChannels(
            inner,
            columns=self.columns,
            column_weights=column_weights,
            rows=self.rows,
            row_weights=row_weights,
            row_bias=row_bias,
        )

    def from_tensors(self, tensors: dict[str, torch.Tensor]):
        if "columns" in tensors or "rows" in tensors:
            return ExactChannels.from_tensors(tensors, self.inner_format)
        return self.inner_format.from_tensors(tensors)


class Int8Linear(torch.nn.Module):
    """`nn.Linear` through `Int8Weight`; returns the input's dtype."""

    def __init__(self, in_features: int, out_features: int, weight: Int8Weight):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_int8 = weight

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernels: native.Kernels = native.STOCK_KERNELS) -> Int8Linear:
        return cls(linear.in_features, linear.out_features, Int8Weight.on(kernels)(linear.weight, linear.bias))

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


class PromptInt8Linear(torch.nn.Module):
    """A plain `nn.Linear` (float32 models: CPUs with VNNI but no BF16) whose prompt-sized products go
    through an int8 copy of its weight once `make_prefill_copy` has made it; decode steps keep the
    original. The same copy protocol as `PackedLinear`, so the engine makes both kinds after ready."""

    def __init__(self, linear: torch.nn.Linear, kernels: native.Kernels):
        super().__init__()
        self.linear, self.kernels = linear, kernels
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.prefill_weight: Int8Weight | None = None
        self.prefill_copy_pending = True
        self.prefill_copy_dtype = torch.int8

    def make_prefill_copy(self, prepared=None, name: str | None = None) -> None:
        """The int8 copy: from `prepared` (weightcache.PreparedWeights) under `name` where it holds one."""
        fmt = Int8Weight.on(self.kernels)
        make = functools.partial(fmt, self.linear.weight, self.linear.bias)
        shape = tuple(self.linear.weight.shape)
        self.prefill_weight = make() if prepared is None else prepared.weight(name, fmt, make, shape)
        self.prefill_copy_pending = False

    def drop_prefill_source(self) -> None:
        self.prefill_copy_pending = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.prefill_weight is None or rows.shape[0] < INT8_PREFILL_ROWS:
            return self.linear(x)
        return self.prefill_weight.matmul(rows).to(x.dtype).view(*x.shape[:-1], self.out_features)


def add_int8_prompt_copies(text_model: torch.nn.Module, kernels: native.Kernels) -> int:
    """Wrap every linear layer of an unpacked text decoder in `PromptInt8Linear`; returns how many."""
    count = 0
    for parent in list(text_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PromptInt8Linear(child, kernels))
                count += 1
    return count
