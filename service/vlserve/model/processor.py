"""The Qwen3-VL processor: conversations into tokens, images into patches, tokens back into text.

vlserve's own, from the checkpoint's files, doing what transformers' Qwen3VLProcessor does for an
image request (tests/test_processor.py holds them equal): the chat template rendered with Jinja in
a sandbox, as transformers renders it (trim_blocks, lstrip_blocks, loop controls, its `tojson`,
`raise_exception` and `strftime_now`, the tokenizer's special tokens as variables); each
<|image_pad|> widened to the image's merged token count; tokens from the checkpoint's tokenizer.json
through `tokenizers`; images resized, scaled, normalised and cut into patches as Qwen2-VL's image
processor does with Pillow. Importing transformers' processor classes took as long as its model
classes (their import chain reaches the modeling code), which model/network.py explains.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image
from tokenizers import Tokenizer as FastTokenizer

from vlserve.errors import ModelDirectoryError
from vlserve.model.config import read_json

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_ASPECT_RATIO = 200


class Tokenizer:
    """tokenizer.json through `tokenizers`, with the special tokens tokenizer_config.json names."""

    def __init__(self, directory: Path):
        try:
            self.backend = FastTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise ModelDirectoryError("%s/tokenizer.json is not a tokenizer: %s" % (directory, error)) from None
        path = directory / "tokenizer_config.json"
        config = read_json(path) if path.is_file() else {}
        self.special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None:
                self.special_tokens[name] = token
        self.chat_template = config.get("chat_template")
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.eos_token_id = self.convert_tokens_to_ids(self.special_tokens.get("eos_token"))
        self.pad_token_id = self.convert_tokens_to_ids(self.special_tokens.get("pad_token"))

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(" '" + suffix, "'" + suffix)
    return text


@dataclass
class ImageProcessor:
    """Qwen2-VL's image processing (Pillow): the size in pixels between size's shortest_edge and
    longest_edge (pixel counts, not edges), each side a multiple of patch_size x merge_size."""

    size: dict[str, int] = field(default_factory=lambda: {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])
    rescale_factor: float = 1 / 255
    resample: int = Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_directory(cls, directory: Path) -> ImageProcessor:
        processor = directory / "processor_config.json"
        if processor.is_file():
            config = read_json(processor).get("image_processor") or {}
        else:
            legacy = directory / "preprocessor_config.json"
            config = read_json(legacy) if legacy.is_file() else {}
        known = {name for name in cls.__dataclass_fields__ if name != "size"}
        values = {key: value for key, value in config.items() if key in known}
        size = dict(config.get("size") or cls().size)
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
        return cls(size=size, **values)

    def __call__(self, images: list[Image.Image], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        patches, grids = [], []
        for image in images:
            image_patches, grid = self.patches(image)
            patches.append(image_patches)
            grids.append(grid)
        return {
            "pixel_values": torch.from_numpy(np.concatenate(patches, axis=0)),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }

    def patches(self, image: Image.Image) -> tuple[np.ndarray, list[int]]:
        """One image's patches, [patches, channels x temporal x patch x patch], and its grid (1, h, w)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            height, width = smart_resize(
                image.height,
                image.width,
                self.patch_size * self.merge_size,
                self.size["shortest_edge"],
                self.size["longest_edge"],
            )
            if (width, height) != image.size:
                image = image.resize((width, height), resample=self.resample)
        pixels = np.moveaxis(np.array(image), -1, 0)
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=pixels.dtype)[:, None, None]
            std = np.array(self.image_std, dtype=pixels.dtype)[:, None, None]
            pixels = (pixels - mean) / std
        return self._patchify(np.asarray(pixels, dtype=np.float32))

    def _patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, list[int]]:
        channels, height, width = pixels.shape
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // patch, width // patch
        blocks = pixels.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        blocks = np.transpose(blocks, (1, 4, 2, 5, 0, 3, 6))  # merged block, its patch, channel, pixel
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, *blocks.shape[5:]))
        return blocks.reshape(grid_h * grid_w, channels * temporal * patch * patch), [1, grid_h, grid_w]

    def tokens_for(self, height: int, width: int) -> int:
        """How many merged tokens an image of this size becomes."""
        h, w = smart_resize(
            height, width, self.patch_size * self.merge_size, self.size["shortest_edge"], self.size["longest_edge"]
        )
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the area within [min, max] pixels,
    the aspect ratio kept as closely as those allow."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            "absolute aspect ratio must be smaller than %d, got %s"
            % (MAX_ASPECT_RATIO, max(height, width) / min(height, width))
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(source)


class Processor:
    """Images-only Qwen3-VL processing from a checkpoint directory's files."""

    def __init__(self, tokenizer: Tokenizer, image_processor: ImageProcessor, chat_template: str | None):
        if not chat_template:
            raise ModelDirectoryError(
                "the checkpoint has no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.chat_template = chat_template
        self._template = compile_template(chat_template)
        self.image_token = IMAGE_TOKEN
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (IMAGE_TOKEN, VISION_START, VISION_END)}
        if None in ids.values():
            missing = [token for token, value in ids.items() if value is None]
            raise ModelDirectoryError("the tokenizer has no %s token" % " or ".join(missing))
        self.image_token_id = ids[IMAGE_TOKEN]
        self.vision_start_token_id, self.vision_end_token_id = ids[VISION_START], ids[VISION_END]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str:
        if tokenize:
            raise ValueError("the processor renders text; tokens come from calling it")
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.tokenizer.special_tokens,
        )

    def __call__(
        self, text: list[str], images: list[Image.Image] | None = None, return_tensors: str = "pt"
    ) -> dict[str, Any]:
        """Tokens of each text (its <|image_pad|> widened to its image's token count, images in order),
        the images' patches and grids; one text in, rows of one."""
        if len(text) != 1:
            raise ValueError("one conversation at a time")
        prompt = text[0]
        found = prompt.count(IMAGE_TOKEN)
        if found != len(images or []):
            raise ValueError("%d %s tokens in the text for %d images" % (found, IMAGE_TOKEN, len(images or [])))
        encoded: dict[str, Any] = {}
        if images:
            encoded.update(self.image_processor(images))
            merge = self.image_processor.merge_size**2
            pieces = prompt.split(IMAGE_TOKEN)
            widened = [pieces[0]]
            for grid, piece in zip(encoded["image_grid_thw"], pieces[1:], strict=True):
                widened.append(IMAGE_TOKEN * int(grid.prod() // merge) + piece)
            prompt = "".join(widened)
        ids = torch.tensor([self.tokenizer.encode(prompt)], dtype=torch.long)
        encoded["input_ids"] = ids
        encoded["attention_mask"] = torch.ones_like(ids)
        encoded["mm_token_type_ids"] = (ids == self.image_token_id).long()
        return encoded

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        return [self.tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]


def load_processor(model_dir: str | Path) -> Processor:
    """The images-only Qwen3-VL processor from a checkpoint directory's files."""
    directory = Path(model_dir)
    tokenizer = Tokenizer(directory)
    chat_template = tokenizer.chat_template or _read_chat_template(directory)
    return Processor(tokenizer, ImageProcessor.from_directory(directory), chat_template)


def _read_chat_template(model_dir: Path) -> str | None:
    for name in ("chat_template.jinja", "chat_template.json"):
        path = model_dir / name
        if path.is_file():
            text = path.read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None
