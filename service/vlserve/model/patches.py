"""The one place vlserve changes transformers' own code, at load, never undone.

- The model's attention: `attention.attention` registered in transformers' AttentionInterface under
  attention.NAME (with sdpa's masks) and named in the text model's and the vision tower's configs.
- Qwen3-VL's module-level `apply_rotary_pos_emb`, which the text attention calls by name: replaced
  by decoderops' rotary, which hands whatever its op does not take (other layouts, dtypes, a
  process without vlserve's kernels) back to the function it replaced (decoderops.STOCK_ROTARY).

Everything else vlserve does to a model it does to that model's own instances (its linear layers,
its norms: model/packing.py, model/decoderops.py). tests/test_architecture.py holds that no other
module assigns to transformers' modules or registers in its interfaces.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.qwen3_vl import modeling_qwen3_vl

from vlserve.kernels.native import Kernels
from vlserve.model import attention, decoderops


def attend_through_vlserve(model: torch.nn.Module, kernels: Kernels) -> None:
    """The language model and the vision tower of a loaded Qwen3-VL attend through vlserve's
    attention, on `kernels`."""
    AttentionInterface.register(attention.NAME, functools.partial(attention.attention, kernels=kernels))
    AttentionMaskInterface.register(attention.NAME, sdpa_mask)  # the same masks as sdpa
    model.config.text_config._attn_implementation = attention.NAME
    model.config.vision_config._attn_implementation = attention.NAME


def decode_through_vlserve(model: torch.nn.Module, kernels: Kernels) -> None:
    """The language model's norms (its own instances) and rotary embedding (transformers' function)
    through vlserve's ops, where `kernels` have them, and its decoder layers' decode steps through the
    layer op where it takes them (decoderops.use_decoder_layers: the layers' own instances)."""
    if decoderops.use_for(model, kernels):
        modeling_qwen3_vl.apply_rotary_pos_emb = functools.partial(decoderops.rotary, op=kernels.rotary())
        decoderops.use_decoder_layers(model, kernels)
