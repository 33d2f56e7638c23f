"""Loading the Qwen3-VL processor: the stock one without its video processor.

The service answers questions about images, never videos. `AutoProcessor` would build
Qwen3VLProcessor with a video processor too, which needs torchvision (PyPI's torchvision wheels are
CUDA builds that do not import beside the CPU torch) and a video_preprocessor_config.json; trying it
first cost every worker start 0.3-0.5 s, failed or not. So the service builds the images-only
processor from the same directory on every host: the same image processor, tokenizer and chat
template, with Qwen3VLProcessor's own code for everything an image request runs.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoImageProcessor, AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor: chat template, <|image_pad|> expansion,
    mm_token_type_ids, decoding and save/load are all inherited."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The parent's token attributes, set as the parent sets them, minus the video processor.
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", "<|vision_start|>")
        self.vision_end_token = getattr(tokenizer, "vision_end_token", "<|vision_end|>")
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)


def load_processor(model_dir: str | Path) -> ProcessorMixin:
    """The images-only Qwen3-VL processor from a checkpoint directory's files."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    chat_template = getattr(tokenizer, "chat_template", None) or _read_chat_template(Path(model_dir))
    return ImageOnlyQwen3VLProcessor(image_processor, tokenizer, chat_template=chat_template)


def _read_chat_template(model_dir: Path) -> str | None:
    for name in ("chat_template.jinja", "chat_template.json"):
        path = model_dir / name
        if path.is_file():
            text = path.read_text()
            if name.endswith(".json"):
                import json  # noqa: PLC0415

                return json.loads(text)["chat_template"]
            return text
    return None
