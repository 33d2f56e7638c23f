"""`vlserve make-test-model`: a Qwen3-VL checkpoint with random weights, built offline.

No model hub is reachable from the machines this project is built and tested on. This writes a
directory that the service loads exactly as it loads the real Qwen3-VL-2B-Instruct: the real model
class and configuration shape, the real processor classes, and a byte-level BPE tokenizer trained
on the spot that carries Qwen's special tokens (at Qwen's ids for `--size real`) and a Qwen-shaped
chat template. Random weights produce junk text: tests check shapes, counts and types, never content.

- `tiny`: about a million parameters; builds and loads in about a second (tests, demos).
- `real`: the true Qwen3-VL-2B-Instruct configuration (hub revision 89644892), about 4.3 GB in
  bfloat16 (benchmarks).

Random weights lack what trained ones have: a few hidden channels whose activations are tens to
thousands of times larger than the rest, in the same channels in every layer (the outlier features
of LLM.int8() and SmoothQuant, the "massive activations" of later studies; Qwen models have them).
They are what makes rounding activations hard. `outlier_channels` gives the checkpoint that shape:
that many channels of the residual stream, the same in every layer, have their norm weights (the
text decoder's input and post-attention norms, the vision blocks' two norms) multiplied by
`outlier_scale`, so every linear layer behind a norm sees inputs with a few channels that much
larger. Quantization is judged on such a checkpoint as well as on the plain one (docs/model.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Qwen's special tokens, in Qwen's order: <|endoftext|> is 151643 in the real vocabulary.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
REAL_FIRST_SPECIAL_ID = 151643
# Qwen2's pre-tokenizer split (the same regex as the real tokenizer.json).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen's chat shape: <|im_start|>role\n...<|im_end|>\n; an image is <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The real Qwen3-VL-2B-Instruct configuration (docs/model.md); `tiny` keeps its shape rules.
SIZES = {
    "real": {
        "text": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        "min_pixels": 65536,
        "max_pixels": 16777216,
        "vocab_size": 151936,
    },
    "tiny": {
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 8192,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        "min_pixels": 32 * 32,
        "max_pixels": 128 * 128,
        "vocab_size": None,  # the tokenizer's length
    },
}


def training_sentences(count: int = 400, seed: int = 0) -> list[str]:
    """Varied English-like sentences about images, enough for a BPE of a few hundred merges."""
    rng = random.Random(seed)
    subjects = ["the cat", "a red car", "two people", "the chart", "this photo", "a small dog", "the street", "a tree"]
    verbs = ["shows", "contains", "is next to", "looks like", "has", "describes", "is behind", "holds"]
    objects = ["a blue sky", "three windows", "some text", "a bar chart", "green grass", "the number 42", "a sign"]
    questions = ["What is in the image?", "How many objects are there?", "Describe the picture.", "What color is it?"]
    lines = []
    for _ in range(count):
        lines.append(
            "%s %s %s. %s %d%%"
            % (
                rng.choice(subjects).capitalize(),
                rng.choice(verbs),
                rng.choice(objects),
                rng.choice(questions),
                rng.randint(0, 999),
            )
        )
    return lines


def build_tokenizer(first_special_id: int | None = None):
    """A byte-level BPE tokenizer with Qwen's pre-tokenizer and special tokens.

    With `first_special_id`, filler entries pad the vocabulary so the special tokens land at that
    id (Qwen's real ids for the real-size checkpoint); fillers are never produced by the merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import Qwen2Tokenizer  # noqa: PLC0415

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[], show_progress=False
    )
    bpe.train_from_iterator(training_sentences(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if first_special_id is not None:
        for index in range(len(vocab), first_special_id):
            vocab["<|filler_%d|>" % index] = index
    # Special tokens go into the vocabulary first, in Qwen's order, so their ids are Qwen's.
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens(QWEN_SPECIAL_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(size: str = "tiny"):
    """The Qwen3VLConfig of a test checkpoint and the tokenizer it agrees with."""
    from transformers import Qwen3VLConfig  # noqa: PLC0415

    if size not in SIZES:
        raise ValueError("size must be one of %s" % ", ".join(SIZES))
    spec = SIZES[size]
    tokenizer = build_tokenizer(REAL_FIRST_SPECIAL_ID if size == "real" else None)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    vocab_size = spec["vocab_size"] or len(tokenizer)
    text = dict(
        spec["text"],
        vocab_size=vocab_size,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        spec["vision"],
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        out_hidden_size=text["hidden_size"],
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return config, tokenizer


OUTLIER_SCALE = 40.0  # how much larger the outlier channels' norm weights are (the issue's measured case)
# The norms whose weights carry the outlier channels: they feed q/k/v and gate/up in the decoder, and
# the attention and the MLP of each vision block.
TEXT_OUTLIER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
VISION_OUTLIER_NORMS = ("norm1.weight", "norm2.weight")


def outlier_channels(width: int, count: int, seed: int) -> list[int]:
    """The `count` channels of a `width`-wide residual stream that carry outliers (seeded, sorted)."""
    import torch  # noqa: PLC0415

    if not 0 <= count <= width:
        raise ValueError("outlier channels must be between 0 and %d, not %d" % (width, count))
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(width, generator=generator)[:count].tolist())


def add_outlier_channels(model, count: int, scale: float, seed: int) -> dict[str, list[int]]:
    """Multiply `count` fixed channels of every outlier norm's weight by `scale`; returns the channels."""
    import torch  # noqa: PLC0415

    channels = {
        "text": outlier_channels(model.config.text_config.hidden_size, count, seed),
        "vision": outlier_channels(model.config.vision_config.hidden_size, count, seed + 1),
    }
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("model.language_model.layers.") and name.endswith(TEXT_OUTLIER_NORMS):
                parameter[channels["text"]] *= scale
            elif name.startswith("model.visual.blocks.") and name.endswith(VISION_OUTLIER_NORMS):
                parameter[channels["vision"]] *= scale
    return channels


def make_test_model(
    directory: str | Path,
    size: str = "tiny",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    outliers: int = 0,
    outlier_scale: float = OUTLIER_SCALE,
) -> Path:
    """Write a Qwen3-VL checkpoint with random weights to `directory` and return its path; `outliers`
    channels of the residual streams carry activations `outlier_scale` times larger (module doc)."""
    import torch  # noqa: PLC0415
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration  # noqa: PLC0415
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: PLC0415
        Qwen2VLImageProcessorPil,
    )

    config, tokenizer = model_config(size)  # refuses an unknown size before anything is written
    outlier_channels(min(config.text_config.hidden_size, config.vision_config.hidden_size), outliers, seed)
    spec = SIZES[size]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # build in the target dtype: no float32 copy of 2 B parameters
    try:
        model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    if size == "tiny":
        # Default init (std 0.02) makes a tiny model say the same token whatever it sees. Wider
        # weights make its output depend on the image and the text, so tests can tell inputs apart.
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() >= 2:
                    weight.normal_(0.0, 2.0 / weight.shape[-1] ** 0.5)
    channels = add_outlier_channels(model, outliers, outlier_scale, seed) if outliers else None
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(directory, safe_serialization=True)

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec["min_pixels"], "longest_edge": spec["max_pixels"]},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    _image_only_processor(image_processor, tokenizer, CHAT_TEMPLATE).save_pretrained(directory)
    # A real checkpoint names the stock processor; loading falls back when it cannot be built.
    for name in ("processor_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            data["processor_class"] = "Qwen3VLProcessor"
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (directory / "vlserve-test-model.json").write_text(
        json.dumps(
            {
                "size": size,
                "seed": seed,
                "dtype": dtype,
                "random_weights": True,
                "parameters": sum(p.numel() for p in model.parameters()),
                "outlier_channels": channels,
                "outlier_scale": outlier_scale if outliers else None,
            },
            indent=2,
        )
        + "\n"
    )
    return directory


def _image_only_processor(image_processor, tokenizer, chat_template):
    """transformers' Qwen3VLProcessor without its video processor (which needs torchvision, whose PyPI
    wheels are CUDA builds that do not import beside the CPU torch), to write the processor's files
    as a real checkpoint has them."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: PLC0415
    from transformers.processing_utils import ProcessorMixin  # noqa: PLC0415

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # The parent's token attributes, set as the parent sets them, minus the video processor.
            for name, default in (("image", "<|image_pad|>"), ("video", "<|video_pad|>")):
                setattr(self, name + "_token", getattr(tokenizer, name + "_token", default))
                setattr(self, name + "_token_id", tokenizer.convert_tokens_to_ids(getattr(self, name + "_token")))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            for name, default in (("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>")):
                setattr(self, name + "_token", getattr(tokenizer, name + "_token", default))
                setattr(self, name + "_token_id", tokenizer.convert_tokens_to_ids(getattr(self, name + "_token")))

    return ImageOnlyQwen3VLProcessor(image_processor, tokenizer, chat_template=chat_template)
