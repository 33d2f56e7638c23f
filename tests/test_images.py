"""Image decoding: orientation, draft decoding of large JPEGs, bounds, refusals."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from sample_images import jpeg_bytes, png_bomb, png_bytes
from vlserve.runtime.images import ImageError, decode_data_uri, load_image

LIMIT = 50_000_000
CAP = 448 * 448


def test_exif_orientation_is_applied():
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": a portrait photo stored landscape
    Image.new("RGB", (400, 200), (10, 200, 10)).save(buffer, "JPEG", exif=exif)
    loaded = load_image(buffer.getvalue(), LIMIT, CAP, "image")
    assert loaded.image.size == (200, 400)


def test_a_large_jpeg_is_decoded_small_and_capped():
    data = jpeg_bytes(size=(4000, 3000))
    loaded = load_image(data, LIMIT, CAP, "image")
    width, height = loaded.image.size
    assert width * height <= 2 * CAP
    assert abs(width / height - 4 / 3) < 0.02
    assert loaded.image.mode == "RGB"
    assert len(loaded.key) == 64  # sha256 of the bytes as sent


@pytest.mark.parametrize("mode", ["RGBA", "P", "L", "CMYK", "I;16"])
def test_every_mode_becomes_rgb(mode):
    buffer = io.BytesIO()
    image = Image.new("RGB", (64, 48), (120, 10, 250)).convert(mode if mode != "I;16" else "I")
    if mode == "I;16":
        image = Image.new("I;16", (64, 48))
    image.save(buffer, "PNG" if mode != "CMYK" else "JPEG")
    assert load_image(buffer.getvalue(), LIMIT, CAP, "image").image.mode == "RGB"


def test_small_images_keep_their_size():
    assert load_image(png_bytes(size=(64, 32)), LIMIT, CAP, "image").image.size == (64, 32)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"GIF89a-not-really", "not an image"),
        (jpeg_bytes()[:600], "could not be decoded"),
        (png_bomb(20000, 20000), "20000x20000"),
    ],
)
def test_refusals_say_why(data, message):
    with pytest.raises(ImageError, match=message) as caught:
        load_image(data, LIMIT, CAP, "messages.0.content.0.image_url")
    assert caught.value.param == "messages.0.content.0.image_url"


def test_data_uris():
    assert decode_data_uri("data:image/png;base64,aGVsbG8=", "p") == b"hello"
    for bad in ("data:image/png;base64,###", "data:image/png,hello", "image/png;base64,aGVsbG8="):
        with pytest.raises(ImageError):
            decode_data_uri(bad, "p")
