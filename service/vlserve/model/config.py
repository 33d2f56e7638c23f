"""A Qwen3-VL checkpoint's configuration: config.json and generation_config.json, as plain dataclasses.

Both layouts a checkpoint may carry are read: the one transformers 5 writes (`rope_parameters` in
each sub-config) and the hub's original one (transformers 4.57: the text model's `rope_scaling` with
`rope_theta` beside it, the vision tower's rope left to its default). A field a file leaves out takes
transformers' own default for Qwen3-VL, so a checkpoint means the same to vlserve as to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vlserve.errors import ModelDirectoryError


@dataclass(frozen=True)
class TextConfig:
    """The language model's shape (transformers' Qwen3VLTextConfig defaults)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope_theta: float = 5000000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)
    max_position_embeddings: int = 128000
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (transformers' Qwen3VLVisionConfig defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class GenerationConfig:
    """What generation_config.json says about sampling and stopping (transformers' defaults where absent)."""

    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    do_sample: bool = False
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 50
    extra: dict[str, Any] = field(default_factory=dict)  # every other key, kept as read


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelDirectoryError("%s is unreadable: %s" % (path, error)) from None
    if not isinstance(data, dict):
        raise ModelDirectoryError("%s does not hold a JSON object" % path)
    return data


def _known(cls, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in data.items() if key in names}


def _text_config(data: dict[str, Any]) -> TextConfig:
    values = _known(TextConfig, data)
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    theta = rope.get("rope_theta", data.get("rope_theta"))
    if theta is not None:
        values["rope_theta"] = float(theta)
    if rope.get("mrope_section") is not None:
        values["mrope_section"] = tuple(rope["mrope_section"])
    if rope.get("rope_type", "default") != "default":
        raise ModelDirectoryError("the text model's rope type %r is not one vlserve runs" % rope["rope_type"])
    if data.get("head_dim") is None and "hidden_size" in data and "num_attention_heads" in data:
        values["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    return TextConfig(**values)


def _vision_config(data: dict[str, Any]) -> VisionConfig:
    values = _known(VisionConfig, data)
    rope = data.get("rope_parameters") or {}
    if rope.get("rope_theta") is not None:
        values["rope_theta"] = float(rope["rope_theta"])
    if "deepstack_visual_indexes" in values:
        values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
    return VisionConfig(**values)


def model_config(data: dict[str, Any]) -> ModelConfig:
    """A config.json's contents as a ModelConfig; ModelDirectoryError where a value cannot be one."""
    try:
        text = data.get("text_config") or {}
        values = _known(ModelConfig, data)
        values.pop("text_config", None)
        values.pop("vision_config", None)
        if "tie_word_embeddings" not in data and "tie_word_embeddings" in text:
            values["tie_word_embeddings"] = text["tie_word_embeddings"]
        config = ModelConfig(
            text_config=_text_config(text), vision_config=_vision_config(data.get("vision_config") or {}), **values
        )
    except (TypeError, ValueError, AttributeError) as error:
        raise ModelDirectoryError(
            "config.json does not describe a Qwen3-VL model vlserve can run: %s" % error
        ) from None
    if sum(config.text_config.mrope_section) * 2 != config.text_config.head_dim:
        raise ModelDirectoryError("config.json's mrope_section does not add up to half the text model's head_dim")
    return config


def load_config(directory: Path) -> ModelConfig:
    return model_config(read_json(directory / "config.json"))


def load_generation_config(directory: Path, config: ModelConfig) -> GenerationConfig:
    """generation_config.json, or (as transformers does without one) the text model's own token ids."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return GenerationConfig(
            eos_token_id=config.text_config.eos_token_id, pad_token_id=config.text_config.pad_token_id
        )
    data = read_json(path)
    values = _known(GenerationConfig, data)
    values.pop("extra", None)
    rest = {key: value for key, value in data.items() if key not in values}
    return GenerationConfig(**values, extra=rest)
