"""Turning what a client sends into a bounded RGB image: data URIs, allowed URLs, uploads.

Everything here refuses bad input with an `ImageError` (a 400 to the client): not an image, a
truncated file, nothing at all, more source pixels than allowed (checked from the header, before
anything is decoded), a URL scheme or host that is not allowed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import urllib.parse
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

# The size limit is ours (max_image_source_pixels, checked from the header before any decoding),
# so Pillow's fixed global one, which would pre-empt it with its own message, is switched off.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class ImageInput:
    image: Image.Image
    key: str  # sha256 of the encoded bytes: the vision cache's key


class ImageError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


def decode_data_uri(uri: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URI."""
    header, sep, payload = uri.partition(",")
    if not sep or not header.startswith("data:"):
        raise ImageError("a data: URI must look like data:image/png;base64,<data>", param)
    if not header.endswith(";base64"):
        raise ImageError("only base64 data: URIs are accepted", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URI's base64 does not decode", param) from None


async def fetch_image_url(url: str, allowed_hosts: list[str], timeout: float, max_bytes: int, param: str) -> bytes:
    """Fetch an http(s) image whose host is allowed, within a timeout and a size cap; no redirects."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ImageError("image URLs must be data:, http: or https:, not %s:" % (parsed.scheme or "(none)"), param)
    host = (parsed.hostname or "").lower()
    if host not in {h.lower() for h in allowed_hosts}:
        raise ImageError(
            "this server does not fetch images from %s (allowed hosts: %s); send the image as a data: URI"
            % (host or "(no host)", ", ".join(allowed_hosts) or "none"),
            param,
        )
    # Imported here: only image URLs need httpx, and importing it costs every worker's start 0.1 s.
    import httpx  # noqa: PLC0415

    try:
        async with (
            httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ImageError("fetching the image gave HTTP %d" % response.status_code, param)
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise ImageError("the image at the URL is over %d bytes" % max_bytes, param, status=413)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as error:
        raise ImageError("could not fetch the image: %s" % error, param) from None


def load_image(data: bytes, max_source_pixels: int, max_pixels: int, param: str) -> ImageInput:
    """Decode an image safely and shrink it toward `max_pixels` (the processor does the exact fit)."""
    if not data:
        raise ImageError("the image is empty (0 bytes)", param)
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_source_pixels:
            raise ImageError(
                "the image is %dx%d = %d pixels; this server accepts at most %d"
                % (width, height, width * height, max_source_pixels),
                param,
            )
        if image.format == "JPEG" and width * height > 4 * max_pixels:
            # Let libjpeg decode at 1/2, 1/4 or 1/8 scale: a large photo costs a fraction to read.
            scale = math.sqrt(max_pixels / (width * height))
            image.draft("RGB", (max(1, int(width * scale)), max(1, int(height * scale))))
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode != "RGB":
            image = image.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:  # Pillow's own message names a Python object: say what it means
        raise ImageError(
            "not an image this server can read (%d bytes, no PNG, JPEG, WebP, GIF or other format Pillow knows)"
            % len(data),
            param,
        ) from None
    except (OSError, ValueError, SyntaxError) as error:  # truncated or corrupt files
        raise ImageError("the image could not be decoded: %s" % error, param) from None
    if image.width * image.height > 2 * max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize(
            (max(32, round(image.width * factor)), max(32, round(image.height * factor))), Image.BICUBIC
        )
    if min(image.size) < 1:
        raise ImageError("the image has no pixels", param)
    return ImageInput(image=image, key=hashlib.sha256(data).hexdigest())
