"""Images for the tests, made on the spot."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def png_bytes(size=(320, 240), color=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def jpeg_bytes(size=(640, 480), color=(20, 120, 220)) -> bytes:
    buffer = io.BytesIO()
    image = Image.linear_gradient("L").resize(size).convert("RGB")
    image.paste(color, (0, 0, size[0] // 2, size[1] // 2))
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return "data:%s;base64,%s" % (mime, base64.b64encode(data).decode())


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid PNG of width x height black pixels that compresses to a few hundred KB."""
    raw_row = b"\x00" + b"\x00" * width  # filter byte + grayscale pixels
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(raw_row) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def image_question(data: bytes, question: str = "What is in the image?", mime: str = "image/png", **extra) -> dict:
    return chat(
        [{"type": "image_url", "image_url": {"url": data_uri(data, mime)}}, {"type": "text", "text": question}], **extra
    )
