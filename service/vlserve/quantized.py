"""Dynamic int8 matrix products for the compute-bound work: the vision tower and prompts (opt-in).

Without AMX, this project's 2-core Sapphire Rapids VM multiplies float32 matrices at ~220-300
GFLOP/s and bfloat16 ones no faster, while `torch._int_mm` (oneDNN, AVX-512 VNNI) reaches
~1000 int8 GOP/s: with the per-row quantization of the input around it, ~800-950. A 448x448 image
through the vision tower measured 2.84 s in float32 and 1.39 s in int8, a 224-token prompt through
the text decoder 2.43 s and 1.14 s.

The scheme is the usual W8A8 dynamic one (torch's `quantize_dynamic`, OpenVINO's CPU dynamic
quantization): each weight row (output channel) gets its own scale, computed once at load; each
input row (token or patch) gets its own scale at every call. The int32 products are exact; the
error is the rounding of weights and inputs to 255 levels. That changes the model's numerics, which
is why nothing turns it on by default: the sizing policy's `quantize: int8` does, per host.
Decoding (one row per sequence, memory-bound) stays on the bfloat16 weights.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT8_PREFILL_ROWS = 16  # int8 overtakes the packed bf16 product from ~8 rows (2048x6144: 1.4 vs 2.4 ms at 16)


def int8_products_supported() -> bool:
    """Whether this torch build multiplies int8 matrices on this CPU (oneDNN's x86 kernels)."""
    try:
        torch._int_mm(torch.ones(32, 32, dtype=torch.int8), torch.ones(32, 32, dtype=torch.int8))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (values, float32 scales) with matrix ~= values * scales[:, None]."""
    wide = matrix.float()
    scales = (wide.abs().amax(dim=1) / INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    values = (wide / scales[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


class Int8Weight:
    """A linear layer's weight (and bias) quantized per output channel, multiplied in int8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.values, self.scales = quantize_rows(weight.detach())  # (out, in) int8, (out,) float32
        self.bias = None if bias is None else bias.detach().float()

    dtype = torch.int8

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, in) of any float dtype -> (n, out) float32."""
        values, scales = quantize_rows(rows)
        out = torch._int_mm(values, self.values.t()).float()
        out.mul_(scales[:, None]).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out


class Int8Linear(torch.nn.Module):
    """`nn.Linear` through `Int8Weight`; returns the input's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8 = Int8Weight(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_int8.matmul(x.reshape(-1, self.in_features))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return "in_features=%d, out_features=%d, bias=%s, int8=dynamic" % (
            self.in_features,
            self.out_features,
            self.weight_int8.bias is not None,
        )


def quantize_vision_tower(visual: torch.nn.Module) -> int:
    """Every linear layer of the vision tower to `Int8Linear`, the rest (norms, patch embedding) to
    float32; returns how many layers were quantized. Quantizing first spares a float32 copy of them."""
    count = 0
    for parent in list(visual.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
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
