"""The language model's linear layers in the service's own layer, whose weight lives in a kernel's
layout: oneDNN-packed bfloat16 (below), plain bfloat16 for vlserve's own decode product
(`NativeBf16Weight`, where that loads: it replaces the packed layout), plain bfloat16 (`PlainWeight`,
CPUs without AVX-512 BF16), or int8 / int4 at the policy's quantize levels (vlserve/kernels/quantized.py).
Every format shares the fused projections and the prompt copies described here.

Decoding one token is a chain of matrix-vector products that read every weight once, so its speed is
the speed at which those reads go. torch's default bf16 `F.linear` reaches about 15 GB/s on this
project's 2-core AVX-512-BF16 machine; the same product on a weight that oneDNN has reordered into
its blocked layout once, at load, reaches about 23 GB/s (the memory's read bandwidth is 24-26 GB/s).
That is the layout IPEX and torch.compile's freezing pass use; here it is applied without either.
Projections of the same input (q, k and v; gate and up) are packed as one weight, as vLLM and
llama.cpp fuse them: a decode step is then 113 products instead of 197, and the small ones read
worst (measured on 28 layers of Qwen3-VL-2B's shapes: 3-8% less time; the outputs are bit for bit
the same as separate products).

A worker does not wait for the reorders: the loader builds the weights with `prepack=False`, they
multiply from their plain layout (`F.linear` on views of the checkpoint) and `layout_steps` reorders
them one per scheduler pass once it is ready (docs/service.md, "Ready first").

Where vlserve's own bfloat16 product loads, the exact level skips all that: its weights are multiplied
where they lie in the checkpoint's memory map (`NativeBf16Weight`), the fused groups as their members.
Everything a level does not convert (the input embedding, norms, an unconverted vision tower) stays
in the map too: the page cache is shared by a host's workers, and the worker is settled when it is
ready. A weight that is converted (packed, rounded, a prompt copy) hands its source's pages back as
it is made (vlserve/model/mapped.py), so resident memory counts each weight once all along.

A prompt is the other kind of work: hundreds of rows at once, compute-bound. Without AMX, float32
GEMMs beat the packed bfloat16 ones from about 48 rows on, so with `prefill_dtype=float32` each
decoder layer also gets a float32 copy of its weight (+5.6 GB) and products of `PREFILL_ROWS` rows
or more run on it; decode steps (one row per sequence) stay on the packed bfloat16 weight.
With `prefill_dtype=int8` (the int4 level, or by hand) the copy is an int8 one (+1.5 GB) and
prompts run through vlserve's int8 product, about twice as fast again.
Writing 5.6 GB of fresh memory took 5-14 s at load on this project's VMs (first-touch page faults),
more than the whole rest of the load, so the float32 copies are not made at load: each layer keeps a
view of its checkpoint weight and the engine makes one copy per scheduler pass after it is ready
(`make_prefill_copy`); until a layer has its copy, its prompts run on the packed weight. Int8 copies
are rounded weights like any other: where a weight cache backs the load they are mapped from its
file at load (`int8_prompt_copies_from`, rounded into it on the first start), and only without one
are they made after ready.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vlserve.kernels import native
from vlserve.kernels.native import STOCK_KERNELS, Kernels
from vlserve.kernels.quantized import (
    INT8_PREFILL_ROWS,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    KernelBound,
    whole,
)
from vlserve.model import mapped
from vlserve.model.outliers import exact_format
from vlserve.sizing.contract import QUANTIZE_LEVELS

# Sibling projections of one input in Qwen3-VL's decoder layers (attention; MLP), packed together.
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PREFILL_ROWS = 64  # from here on a float32 product beats the packed bf16 one (crossover ~48 rows measured)


def packing_supported(dtype: torch.dtype) -> bool:
    """Packed bf16 needs a oneDNN build with bf16 kernels for this CPU (x86: AVX-512 BF16 or AMX)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the op (not x86)
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # The batch-size hint only picks the layout; other batch sizes run on the same packed weight.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedBf16Weight:
    """A bfloat16 weight in oneDNN's blocked layout: same math, same outputs as `F.linear`. It starts as
    its checkpoint views (`parts`, one per fused member) and is reordered by `finish_layout`: at once,
    or with `prepack=False` in the worker's after-ready steps (`layout_steps`; 3-4 s for the whole
    model here), multiplying its parts with `F.linear` until then."""

    dtype = torch.bfloat16

    def __init__(
        self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None, *, prepack: bool = True
    ):
        self.parts: list[torch.Tensor] | None = [w.detach() for w in (weight if isinstance(weight, list) else [weight])]
        self.packed: torch.Tensor | None = None
        self.bias = None if bias is None else bias.detach().clone()
        if prepack:
            self.finish_layout()

    @property
    def layout_pending(self) -> bool:
        return self.packed is None

    def finish_layout(self) -> None:
        if self.packed is None:
            parts, self.packed = self.parts, _pack(whole(self.parts))
            self.parts = None
            mapped.release(*parts)

    @property
    def nbytes(self) -> int:
        stored = [self.packed] if self.packed is not None else self.parts
        return sum(t.nbytes for t in stored) + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        out = torch.cat([torch.nn.functional.linear(rows, part) for part in self.parts], dim=-1)
        return out if self.bias is None else out.add_(self.bias)


class NativeBf16Weight(KernelBound):
    """A bfloat16 weight multiplied where it lies, in the checkpoint's memory map: decode steps and short
    prompts (up to native.MAX_ROWS rows) through vlserve's own AVX-512 BF16 product
    (vlserve.kernels.native), longer prompts through `F.linear` (oneDNN: AMX where the CPU has it). On
    AMX CPUs oneDNN's one-row products on the packed layout swing between about 9 and 20 GB/s; the own
    product holds the memory's speed (vlserve/kernels/native.py has the figures).

    Its layout is the checkpoint's own (out, in), so nothing is copied: no fused matrix either, each
    member of a fused group (`parts`) is its own product. Copying the exact level's 4 GB into fresh
    anonymous memory took 16-26 s after ready on this project's 2-vCPU EPYC (first-touch faults), while
    the mapped parts decode as fast (TPOT median 87.6 ms over 7 starts against 91.5 copied, interleaved,
    the page cache mapped in 2 MiB pages), are shared by a host's workers and make a worker settled as
    soon as it is ready. A tied output head is the input embedding itself, no copy either."""

    dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None):
        self.op = self.kernels.bf16_linear()
        if self.op is None:
            raise RuntimeError("vlserve's bfloat16 product is not loaded")
        self.parts = [w.detach() for w in (weight if isinstance(weight, list) else [weight])]
        self.native_rows = native.MAX_ROWS if self.parts[0].shape[1] % native.BF16_INPUT_MULTIPLE == 0 else 0
        self.bias = None if bias is None else bias.detach().clone()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts) + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] <= self.native_rows and rows.dtype == torch.bfloat16:
            outs = [self.op(rows, part, None) for part in self.parts]
        else:
            outs = [torch.nn.functional.linear(rows, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out.add_(self.bias)


class PlainWeight:
    """A weight as it is, owned (copied out of the checkpoint's map), multiplied by `F.linear`: for CPUs
    without oneDNN's bf16 kernels, where bfloat16 weights still halve the bytes a decode step reads
    (held to AVX2: 90 ms a token against float32's 309) and prompts want a float32 copy."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None = None):
        self.weight = whole(weight).detach().clone()
        self.dtype = self.weight.dtype
        self.bias = None if bias is None else bias.detach().clone()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows.to(self.dtype), self.weight, self.bias)


class PackedGroup:
    """Linear layers that always see the same input, packed as one weight: the first member called
    with an input computes every member's output, the others take theirs from it."""

    def __init__(self, linears: list[torch.nn.Linear], make_weight: Callable):
        """`make_weight(parts, bias)`: the members' weights as a list, fused by the format itself."""
        self.sizes = [linear.out_features for linear in linears]
        bias = None
        if any(linear.bias is not None for linear in linears):
            bias = torch.cat(
                [
                    linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias.detach()
                    for linear in linears
                ]
            )
        self.weight = make_weight([linear.weight.detach() for linear in linears], bias)
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._served = 0

    def output(self, index: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Member `index`'s product for input `x` (`rows`: x as a matrix)."""
        if x is not self._input:
            out = self.weight.matmul(rows)
            self._outputs = [part.contiguous() for part in out.split(self.sizes, dim=-1)]
            self._input, self._served = x, 0
        self._served += 1
        result = self._outputs[index]
        if self._served == len(self.sizes):  # every member has its output: hold on to nothing
            self._input, self._outputs = None, []
        return result


class PackedLinear(torch.nn.Module):
    """`nn.Linear` whose weight lives in a kernel's own layout (`make_weight`: packed bfloat16, int8,
    int4), alone or in a `PackedGroup`; optionally with a copy in another dtype for prompts."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        make_weight: Callable = PackedBf16Weight,
        prefill_dtype: torch.dtype | None = None,
        group: PackedGroup | None = None,
        index: int = 0,
        *,
        prefill_format: Callable = Int8Weight,
    ):
        """`prefill_format`: what an int8 prompt copy is made as (Int8Weight, keeping the outlier
        channels of the streams this layer touches exact where the model has them)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group, self.index = group, index
        # Plain attributes, not buffers: nothing should copy or move them behind our back.
        self.weight = None if group is not None else make_weight(linear.weight, linear.bias)
        self.prefill_weight = self.prefill_bias = None
        self.prefill_format = prefill_format
        self._prefill_source: tuple[torch.Tensor, torch.Tensor | None, torch.dtype] | None = None
        if prefill_dtype is not None and prefill_dtype != linear.weight.dtype:
            bias = None if linear.bias is None else linear.bias.detach()
            self._prefill_source = (linear.weight.detach(), bias, prefill_dtype)

    @property
    def stored(self):
        """The weight decode steps read (this layer's, or its group's)."""
        return self.weight if self.group is None else self.group.weight

    @property
    def prefill_copy_pending(self) -> bool:
        return self._prefill_source is not None

    @property
    def prefill_copy_dtype(self) -> torch.dtype | None:
        return None if self._prefill_source is None else self._prefill_source[2]

    def make_prefill_copy(self, prepared=None, name: str | None = None) -> None:
        """Convert the plain weight into the prefill dtype and drop the view of the checkpoint. An int8
        copy comes from `prepared` (weightcache.PreparedWeights) under `name` where it holds one, and
        is kept there for the cache file otherwise."""
        weight, bias, dtype = self._prefill_source
        if dtype == torch.int8:
            fmt, make = self.prefill_format, functools.partial(self.prefill_format, weight, bias)
            self.prefill_weight = make() if prepared is None else prepared.weight(name, fmt, make, tuple(weight.shape))
        else:
            self.prefill_bias = None if bias is None else bias.to(dtype)
            self.prefill_weight = weight.to(dtype)  # set last: forward() tests this one
        self._prefill_source = None
        if not isinstance(self.stored, NativeBf16Weight):  # else its decode steps still read these pages
            mapped.release(weight, bias)

    def drop_prefill_source(self) -> None:
        """Give up on the copy (prompts keep running on the packed weight) and release the view."""
        self._prefill_source = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if (
            self.prefill_weight is not None
            and self.prefill_weight.dtype == torch.int8
            and rows.shape[0] >= INT8_PREFILL_ROWS
        ):
            out = self.prefill_weight.matmul(rows)
        elif self.prefill_weight is not None and rows.shape[0] >= PREFILL_ROWS:
            wide = rows.to(self.prefill_weight.dtype)
            out = torch.nn.functional.linear(wide, self.prefill_weight, self.prefill_bias)
        elif self.group is not None:
            out = self.group.output(self.index, x, rows)
        else:
            out = self.weight.matmul(rows)
        if out.dtype != x.dtype:  # a test, not a call: a decode step has 197 of these
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return "in_features=%d, out_features=%d, weight=%s%s%s" % (
            self.in_features,
            self.out_features,
            type(self.stored).__name__,
            "" if self.group is None else " (part %d of %d)" % (self.index + 1, len(self.group.sizes)),
            "" if self.prefill_weight is None else ", prefill=%s" % str(self.prefill_weight.dtype).split(".")[-1],
        )


def weight_formats(
    level: str, packed: bool = True, native: bool = False, kernels: Kernels = STOCK_KERNELS
) -> tuple[Callable, Callable | None]:
    """(decoder layers', output head's) weight makers for a quantize level, on `kernels`; at none,
    plain bfloat16 for vlserve's own product (`native`), else oneDNN-packed bfloat16 or (`packed`
    False) plain weights, where the tied head stays the embedding's (None)."""
    if level == "none":
        if native:
            return NativeBf16Weight.on(kernels), NativeBf16Weight.on(kernels)
        return (PackedBf16Weight, PackedBf16Weight) if packed else (PlainWeight, None)
    head = Int8Weight.on(kernels)  # int4 keeps the output head in int8, as llama.cpp's Q4_K_M keeps it wider
    if level == "int8":
        return Int8Weight.on(kernels), head
    if level == "int4":
        return Int4Weight.on(kernels), head
    raise ValueError("quantize level must be one of %s, not %r" % (", ".join(QUANTIZE_LEVELS), level))


def pack_language_model(
    model: torch.nn.Module,
    prefill_dtype: torch.dtype | None = None,
    *,
    level: str = "none",
    packed: bool = True,
    native: bool = False,
    prepared=None,
    defer_layouts: bool = False,
    channels: dict[str, list[int]] | None = None,
    kernels: Kernels = STOCK_KERNELS,
) -> int:
    """Put every linear layer of the text decoder and the output head in the layout of `level`
    (none: oneDNN-packed bfloat16, plain weights where `packed` is False, plain ones for vlserve's own
    bfloat16 product where `native`; int8; int4); returns how many layers were converted.

    `model` is a Qwen3VLForConditionalGeneration in bfloat16. The vision tower is not packed (it runs
    once per image on hundreds of rows at a time, where the plain kernels are already compute-bound):
    `convert_vision_tower` converts it.
    `prefill_dtype`: the decoder layers' copy for prompts (the head only ever sees the last row), made
    later by `make_prefill_copy` on each layer that `pending_prefill_copies` lists.
    `prepared` (weightcache.PreparedWeights): quantized weights taken from the weight cache by layer
    name instead of being rounded again, and those rounded here kept for it.
    `defer_layouts`: leave oneDNN's reorders to `layout_steps` (the worker runs them after ready).
    `channels`: the residual streams' outlier channels, which quantized layers keep exact
    (vlserve/model/outliers.py); a fused group is named by its first member.
    `kernels`: what the weights' products run on (vlserve.kernels.native.load).
    """
    decoder_weight, head_weight = weight_formats(level, packed, native, kernels)

    def maker(fmt: Callable, name: str, role: str | None = None) -> Callable:
        if level != "none":
            fmt = exact_format(fmt, role or name, channels)
        make = functools.partial(fmt, prepack=False) if defer_layouts and hasattr(fmt, "finish_layout") else fmt
        if prepared is None or not hasattr(fmt, "from_tensors"):
            return make

        def from_cache_or_made(weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None):
            parts = weight if isinstance(weight, list) else [weight]
            shape = (sum(part.shape[0] for part in parts), parts[0].shape[1])
            return prepared.weight(name, fmt, functools.partial(make, weight, bias), shape)

        return from_cache_or_made

    count = 0
    for parent_name, parent in list(model.model.language_model.named_modules(prefix="model.language_model")):
        for names in FUSED_PROJECTIONS:
            linears = [getattr(parent, name, None) for name in names]
            if all(isinstance(linear, torch.nn.Linear) for linear in linears):
                first = "%s.%s" % (parent_name, names[0])  # every member reads the same input
                make = maker(decoder_weight, "%s.%s" % (parent_name, "+".join(names)), first)
                group = PackedGroup(linears, make)
                for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                    prompt = exact_format(Int8Weight.on(kernels), "%s.%s" % (parent_name, name), channels)
                    setattr(
                        parent, name, PackedLinear(linear, make, prefill_dtype, group, index, prefill_format=prompt)
                    )
                count += len(names)
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                full = "%s.%s" % (parent_name, name)
                prompt = exact_format(Int8Weight.on(kernels), full, channels)
                setattr(
                    parent, name, PackedLinear(child, maker(decoder_weight, full), prefill_dtype, prefill_format=prompt)
                )
                count += 1
    if head_weight is None:
        return count
    model.lm_head = PackedLinear(model.lm_head, maker(head_weight, "lm_head"))
    return count + 1


def convert_vision_tower(
    model: torch.nn.Module,
    vision_dtype: torch.dtype | None,
    prepared=None,
    channels: dict[str, list[int]] | None = None,
    *,
    rest: torch.dtype = torch.float32,
    kernels: Kernels = STOCK_KERNELS,
) -> None:
    """The vision tower to `vision_dtype`, on the way out of the memory map (one copy instead of two).
    int8: its linear layers quantized on `kernels`, keeping the streams' outlier `channels` exact
    (vlserve/kernels/quantized.py), the rest (norms, GELU, attention) in `rest`."""
    if vision_dtype == torch.int8:
        quantize_vision_tower(model.model.visual, prepared, "model.visual", channels, kernels, rest=rest)
    elif vision_dtype is not None and vision_dtype != model.dtype:
        model.model.visual.to(vision_dtype)


def layout_steps(model: torch.nn.Module) -> list[Callable[[], None]]:
    """One step per weight still waiting for its kernel's layout (`defer_layouts`), each making it.

    Until its step has run a weight multiplies from its plain layout (the same results, more slowly:
    oneDNN's matmul on plain int8, `F.linear` on bfloat16), so a worker can be ready first."""
    seen: set[int] = set()
    steps = []
    for module in model.modules():
        weight = getattr(module, "stored", None)
        if getattr(weight, "layout_pending", False) and id(weight) not in seen:
            seen.add(id(weight))
            steps.append(weight.finish_layout)
    return steps


def pending_prefill_copies(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers still waiting for their prompt copy: PackedLinear, or quantized.PromptInt8Linear."""
    return [m for m in model.modules() if getattr(m, "prefill_copy_pending", False)]


def int8_prompt_copies_from(model: torch.nn.Module, prepared) -> int:
    """Every pending int8 prompt copy taken from the weight cache (`prepared`), or rounded now and kept
    for its file, under `<layer>.prompt`: a worker maps them at load instead of rounding 1.5 GB after
    every start, and a host's workers share their pages. Returns how many were mapped."""
    taken = prepared.taken
    for name, module in model.named_modules():
        if getattr(module, "prefill_copy_pending", False) and module.prefill_copy_dtype == torch.int8:
            module.make_prefill_copy(prepared, "%s.prompt" % name)
    return prepared.taken - taken


def quantize_vision_tower(
    visual: torch.nn.Module,
    prepared=None,
    prefix: str = "visual",
    channels: dict[str, list[int]] | None = None,
    kernels: Kernels = STOCK_KERNELS,
    *,
    rest: torch.dtype = torch.float32,
) -> int:
    """Every linear layer of the vision tower to `Int8Linear`, the rest (norms, patch embedding) to
    `rest`; returns how many layers were quantized. Quantizing first spares a float32 copy of them.
    `prepared` (a weightcache.PreparedWeights): weights taken from the cache, or kept for it, by name
    under `prefix`; `channels`: the streams' outlier channels, kept exact (vlserve/model/outliers.py)."""
    count = 0
    for parent_name, parent in list(visual.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                full = ".".join(part for part in (prefix, parent_name, name) if part)
                fmt = exact_format(Int8Weight.on(kernels), full, channels)
                make = functools.partial(fmt, child.weight, child.bias)
                shape = tuple(child.weight.shape)
                weight = make() if prepared is None else prepared.weight(full, fmt, make, shape)
                layer = Int8Linear(child.in_features, child.out_features, weight)
                setattr(parent, name, layer)
                count += 1
    visual.to(rest)
    return count
