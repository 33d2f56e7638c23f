"""Conversations into prompts: the chat template, tokens and image patches; no model involved."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from vlserve.errors import ContextLengthExceeded, InvalidRequest
from vlserve.runtime.requests import Prompt
from vlserve.settings import LimitSettings


def build_prompt(processor, messages: list[dict[str, Any]], max_images: int) -> Prompt:
    """Chat template, tokens and image patches for one conversation.

    `messages`: [{"role", "content": str | [{"type": "text", "text"}, {"type": "image", "image": ImageInput}]}].
    """
    template_messages, images = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            template_messages.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        template_messages.append({"role": message["role"], "content": parts})
    if len(images) > max_images:
        raise InvalidRequest("%d images in one request; the limit is %d" % (len(images), max_images), param="messages")
    try:
        text = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
        encoded = processor(text=[text], images=[i.image for i in images] or None, return_tensors="pt")
    except ValueError as error:  # e.g. an aspect ratio the processor refuses (over 200:1)
        raise InvalidRequest("the request could not be processed: %s" % error, param="messages") from None
    input_ids = encoded["input_ids"][0]
    keys = [i.key for i in images]
    digest = hashlib.sha256(input_ids.numpy().tobytes())
    for key in keys:
        digest.update(key.encode())
    return Prompt(
        input_ids=input_ids,
        mm_token_type_ids=encoded["mm_token_type_ids"][0],
        pixel_values=encoded.get("pixel_values"),
        image_grid_thw=encoded.get("image_grid_thw"),
        image_keys=keys,
        cache_key=digest.hexdigest(),
    )


def resolve_max_tokens(prompt: Prompt, requested: int | None, limits: LimitSettings) -> int:
    """The answer's token budget: what the request asks, or the default, within the context."""
    room = limits.max_context_tokens - prompt.tokens
    if room < 1:
        raise ContextLengthExceeded(
            "the prompt has %d tokens; this server's context is %d tokens" % (prompt.tokens, limits.max_context_tokens),
            param="messages",
        )
    if requested is None:
        return min(limits.max_tokens_default, room)
    if requested > room:
        raise ContextLengthExceeded(
            "max_tokens %d plus the prompt's %d tokens exceed this server's context of %d tokens"
            % (requested, prompt.tokens, limits.max_context_tokens),
            param="max_tokens",
        )
    return requested


def image_tokens_only(prompt: Prompt, processor) -> Prompt:
    """The prompt cut to its first image's tokens, from <|vision_start|> to <|vision_end|>."""
    ids = prompt.input_ids.tolist()
    first, last = ids.index(processor.vision_start_token_id), ids.index(processor.vision_end_token_id) + 1
    return replace(
        prompt, input_ids=prompt.input_ids[first:last], mm_token_type_ids=prompt.mm_token_type_ids[first:last]
    )
