"""oneDNN-packed bfloat16 weights for the language model's linear layers.

Decoding one token is a chain of matrix-vector products that read every weight once, so its speed is
the speed at which those reads go. torch's default bf16 `F.linear` reaches about 15 GB/s on this
project's 2-core AVX-512-BF16 machine; the same product on a weight that oneDNN has reordered into
its blocked layout once, at load, reaches about 23 GB/s (the memory's read bandwidth is 24-26 GB/s).
That is the layout IPEX and torch.compile's freezing pass use; here it is applied without either.

Packing copies the weights out of the checkpoint's memory map, so everything else is copied too and
the map is released: resident memory then counts each weight once and tells the memory guard the
truth. The tied output embedding gets its own packed copy (+0.6 GB for Qwen3-VL-2B); the input
embedding keeps the plain one for lookups.
"""

from __future__ import annotations

import gc

import torch


def packing_supported(dtype: torch.dtype) -> bool:
    """Packed bf16 needs a oneDNN build with bf16 kernels for this CPU."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(torch.nn.Module):
    """`nn.Linear` whose weight lives in oneDNN's blocked layout; same math, same outputs."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The batch-size hint only picks the layout; other batch sizes run on the same packed weight.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return "in_features=%d, out_features=%d, bias=%s, packed=onednn" % (
            self.in_features,
            self.out_features,
            self.bias is not None,
        )


def pack_language_model(model: torch.nn.Module, vision_dtype: torch.dtype | None = None) -> int:
    """Pack every linear layer of the text decoder and the output head; returns how many were packed.

    `model` is a Qwen3VLForConditionalGeneration in bfloat16. The vision tower is not packed: it runs
    once per image on hundreds of rows at a time, where the plain kernels are already compute-bound;
    `vision_dtype` converts it on the way out of the memory map (one copy instead of two).
    """
    if vision_dtype is not None and vision_dtype != model.dtype:
        model.model.visual.to(vision_dtype)
    count = 0
    text = model.model.language_model
    for parent in list(text.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PackedLinear(child))
                count += 1
    model.lm_head = PackedLinear(model.lm_head)
    count += 1
    _release_checkpoint_map(model)
    return count


def _release_checkpoint_map(model: torch.nn.Module) -> None:
    """Copy the remaining parameters and buffers out of the safetensors memory map, so it can close."""
    converted = {id(p) for p in model.model.visual.parameters() if p.dtype != model.lm_head.packed_weight.dtype}
    with torch.no_grad():
        for parameter in model.parameters():
            if id(parameter) not in converted:  # a converted tensor is a copy already
                parameter.data = parameter.data.clone()
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
    gc.collect()
