"""The fixed request set: synthetic photos of a given size and fixed questions, as chat payloads.

Images are generated, not shipped: a seeded picture with gradients, shapes and noise, JPEG-encoded
like a camera photo, so its size on the wire and its decode cost are a photo's. The same seed gives
the same bytes on every machine, so two runs send the same requests.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

QUESTIONS = (
    "What is shown in this picture? Answer in one sentence.",
    "Which colours dominate the picture?",
    "How many distinct shapes can you see?",
    "Describe the picture's background.",
)


def synthetic_photo(width: int, height: int, seed: int) -> bytes:
    """A JPEG of `width` x `height` pixels that looks like a photo to an encoder: smooth areas, edges, noise."""
    from PIL import Image, ImageDraw, ImageFilter  # noqa: PLC0415 - Pillow only where images are made

    rng = random.Random(seed)
    top = tuple(rng.randrange(256) for _ in range(3))
    bottom = tuple(rng.randrange(256) for _ in range(3))
    gradient = Image.linear_gradient("L").resize((width, height))
    picture = Image.composite(
        Image.new("RGB", (width, height), top), Image.new("RGB", (width, height), bottom), gradient
    )
    draw = ImageDraw.Draw(picture)
    for _ in range(12):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = (
            x0 + rng.randrange(width // 8 + 1, width // 2 + 2),
            y0 + rng.randrange(height // 8 + 1, height // 2 + 2),
        )
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    picture = picture.filter(ImageFilter.GaussianBlur(1.5))
    # Sensor-like grain from the seeded generator (Image.effect_noise would differ on every call).
    grain = Image.frombytes("L", (width // 4, height // 4), rng.randbytes((width // 4) * (height // 4)))
    picture = Image.blend(picture, grain.resize((width, height)).convert("RGB"), 0.08)
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=90)
    return out.getvalue()


def parse_size(text: str) -> tuple[int, int]:
    """'1280x720' -> (1280, 720)."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError("image size %r is not WIDTHxHEIGHT" % text) from None
    if not (16 <= width <= 16384 and 16 <= height <= 16384):
        raise ValueError("image size %r is outside 16..16384 pixels per side" % text)
    return width, height


@dataclass(frozen=True)
class Workload:
    """What every request of a run looks like."""

    image_size: tuple[int, int] | None = (1280, 720)  # None: text-only questions
    max_tokens: int = 32
    ignore_eos: bool = True  # fixed-length answers, where the server allows it (vLLM and vlserve do)
    distinct_images: bool = True  # every request its own image (no vision-cache hits) or one image for all
    seed: int = 0

    def image(self, index: int) -> bytes | None:
        if self.image_size is None:
            return None
        return synthetic_photo(*self.image_size, seed=self.seed + (index if self.distinct_images else 0))

    def payload(self, index: int, model: str | None, question: int | None = None) -> dict:
        """The chat-completion body of request `index` (question `question`, default: index's)."""
        text = QUESTIONS[(index if question is None else question) % len(QUESTIONS)]
        data = self.image(index)
        content: list[dict] | str
        if data is None:
            content = text
        else:
            uri = "data:image/jpeg;base64," + base64.b64encode(data).decode()
            content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body
