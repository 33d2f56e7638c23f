"""Outlier channels of the residual streams: found on the model's own activations, kept exact.

Trained transformers carry a few channels of their residual stream whose activations are tens to
thousands of times larger than the rest, in the same channels in every layer (the outlier features of
LLM.int8() and SmoothQuant, the "massive activations" of later studies). Rounding hurts twice there:
the layers that read the stream through a norm see those channels dominate their inputs and the
weights that multiply them; and an error that a layer writes into such a channel is multiplied again
by the next norms' large weights. Measured on the real-size test checkpoint with four such channels 40
times larger (`make-test-model --outlier-channels 4`; docs/quantization.md): with the inputs rounded
per block of 32 and Q8_0 weights the int8 level's mean KL was 3.7x its figure without them; keeping
the four channels exact on both sides brought it to 2.4x, and the int4 level from 2.6x to 1.3x, the
medians to where they are without outliers.

So a quantized layer keeps exact (`quantized.ExactChannels`):
- where it reads a stream (the text decoder's q/k/v, gate/up and the output head; the vision blocks'
  qkv and first MLP layer): the stream's outlier channels of its input: their weights stay the
  checkpoint's and their inputs are never rounded (they leave the rounded product and are multiplied
  apart, in float32);
- where it writes into a stream (the text decoder's o_proj and down_proj, the vision mergers' last
  layer, which write image features into the text stream; the vision blocks' proj and second MLP
  layer): its outputs in those channels, from the checkpoint's weights.

The channels are found once, when the weights are rounded (the weight cache keeps them with the
weights): the exact model reads one generated picture and question (`calibration_inputs`), and a
channel is an outlier where, at some layer that reads the stream, its largest input is more than
OUTLIER_RATIO times that of the median channel (Gaussian-like channels stay within ~2x of each other;
the outlier channels of the test checkpoint stand 15-40x above). At most MAX_SHARE of a stream's
width (or MIN_KEPT channels) is kept exact, the largest first. A checkpoint without outliers keeps
none, and its layers run as before.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from vlserve.kernels.quantized import ExactFormat
from vlserve.model.network import prompt_pass

log = logging.getLogger(__name__)

OUTLIER_RATIO = 8.0
MAX_SHARE = 1 / 64  # at most 32 channels of Qwen3-VL-2B's 2048-wide text stream, 16 of the vision one's
MIN_KEPT = 8  # and up to 8 of a narrow stream's (the tiny test checkpoint's is 64 wide)
STREAMS = ("text", "vision")
# Layer names (as named_modules gives them) that read or write each stream, by pattern.
READERS = {
    "text": re.compile(r"^(model\.language_model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)|lm_head)$"),
    "vision": re.compile(r"^model\.visual\.blocks\.\d+\.(attn\.qkv|mlp\.linear_fc1)$"),
}
WRITERS = {
    "text": re.compile(
        r"^model\.(language_model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)"
        r"|visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc2)$"
    ),
    "vision": re.compile(r"^model\.visual\.blocks\.\d+\.(attn\.proj|mlp\.linear_fc2)$"),
}
CALIBRATION_QUESTION = "Describe everything in this picture, then list its colours and shapes."


def roles(name: str) -> tuple[str | None, str | None]:
    """(the stream layer `name` reads, the stream it writes): either may be None."""
    reads = next((stream for stream, pattern in READERS.items() if pattern.match(name)), None)
    writes = next((stream for stream, pattern in WRITERS.items() if pattern.match(name)), None)
    return reads, writes


def calibration_inputs(processor: Any, size: int = 448) -> dict[str, torch.Tensor]:
    """A generated picture (smooth gradients, blocks of colour, grain: seeded, the same everywhere) and a
    question, through the chat template and the image processor."""
    from PIL import Image  # noqa: PLC0415 - Pillow comes with the service

    generator = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 1, size)
    picture = torch.stack(
        [ramp[None, :].expand(size, size), ramp[:, None].expand(size, size), 1 - ramp[None, :].expand(size, size)]
    )
    cells = torch.rand(3, 8, 8, generator=generator).repeat_interleave(size // 8, 1).repeat_interleave(size // 8, 2)
    picture = (0.5 * picture + 0.4 * cells + 0.1 * torch.rand(3, size, size, generator=generator)).clamp(0, 1)
    image = Image.fromarray((picture.permute(1, 2, 0) * 255).to(torch.uint8).numpy())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CALIBRATION_QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


def find(model: torch.nn.Module, processor: Any) -> dict[str, list[int]]:
    """Each stream's outlier channels, sorted, from one pass of the exact model over the calibration input."""
    ratios: dict[str, torch.Tensor] = {}

    def record(stream: str):
        def hook(_module, args):
            rows = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            largest = rows.abs().amax(dim=0)
            ratio = largest / largest.median().clamp(min=torch.finfo(torch.float32).tiny)
            ratios[stream] = ratio if stream not in ratios else torch.maximum(ratios[stream], ratio)

        return hook

    handles = []
    for name, module in model.named_modules():
        stream, _ = roles(name)
        if stream is not None and isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(record(stream)))
    try:
        with torch.inference_mode():
            prompt_pass(model, calibration_inputs(processor))
    finally:
        for handle in handles:
            handle.remove()
    found = {}
    for stream in STREAMS:
        ratio = ratios.get(stream)
        if ratio is None:
            found[stream] = []
            continue
        flagged = (ratio > OUTLIER_RATIO).nonzero().flatten()
        keep = max(MIN_KEPT, int(ratio.numel() * MAX_SHARE))
        if flagged.numel() > keep:
            flagged = flagged[ratio[flagged].topk(keep).indices]
        found[stream] = sorted(flagged.tolist())
        log.info(
            "outlier channels of the %s stream: %s (largest input / the median channel's: %s)",
            stream,
            found[stream] or "none",
            ", ".join("%.0f" % float(ratio[c]) for c in found[stream]) or "at most %.1f" % float(ratio.max()),
        )
    return found


class ChannelSets:
    """The streams' outlier channels as the weight cache keeps them (one int64 tensor a stream)."""

    shape = None

    def __init__(self, channels: dict[str, list[int]]):
        self.channels = channels

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ChannelSets:
        return cls({stream: tensors[stream].tolist() for stream in STREAMS})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {stream: torch.tensor(self.channels[stream], dtype=torch.int64) for stream in STREAMS}


def channels_for(model: torch.nn.Module, processor: Any, prepared) -> dict[str, list[int]]:
    """The streams' outlier channels: from the weight cache where it has them, else found now (and kept
    for it). `prepared` is the weightcache.PreparedWeights the loader rounds into."""
    return prepared.weight("outlier_channels", ChannelSets, lambda: ChannelSets(find(model, processor))).channels


def exact_format(inner_format, name: str, channels: dict[str, list[int]] | None):
    """`inner_format` for the layer `name`, keeping the outlier `channels` of the streams it reads and
    writes exact (this module); the format itself where it touches none."""
    if not channels:
        return inner_format
    reads, writes = roles(name)
    columns = channels.get(reads) if reads else None
    rows = channels.get(writes) if writes else None
    return ExactFormat(inner_format, columns, rows) if columns or rows else inner_format
