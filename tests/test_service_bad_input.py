"""Bad input: each gets a 4xx with the one error shape, the worker lives on, and memory stays put."""

from __future__ import annotations

import json

import httpx
import pytest

from sample_images import chat, data_uri, image_question, jpeg_bytes, png_bomb, png_bytes

TOO_BIG_BODY = 21 * 2**20  # the default max_upload_bytes is 20 MiB


def image_url(url: str) -> dict:
    return chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}])


CORPUS = {
    "not an image": (image_url(data_uri(b"this is plain text, not a picture")), 400, "invalid_image"),
    "truncated jpeg": (image_url(data_uri(jpeg_bytes()[:700], "image/jpeg")), 400, "invalid_image"),
    "zero-byte image": (image_url("data:image/png;base64,"), 400, "invalid_image"),
    "20000x20000 png bomb": (image_url(data_uri(png_bomb())), 400, "invalid_image"),
    "base64 that does not decode": (image_url("data:image/png;base64,@@@not-base64@@@"), 400, "invalid_image"),
    "data uri without base64": (image_url("data:image/png,rawbytes"), 400, "invalid_image"),
    "file url": (image_url("file:///etc/passwd"), 400, "invalid_image"),
    "ftp url": (image_url("ftp://127.0.0.1/picture.png"), 400, "invalid_image"),
    "http url not allowed": (image_url("http://127.0.0.1:9/picture.png"), 400, "invalid_image"),
    "200:1 aspect ratio": (image_question(png_bytes(size=(4000, 10))), 400, "invalid_request"),
    "too many images": (
        chat([{"type": "image_url", "image_url": {"url": data_uri(png_bytes())}}] * 5),
        400,
        "too_many_images",
    ),
    "prompt over the context": (chat("word " * 6000), 400, "context_length_exceeded"),
    "max_tokens 0": (chat("Hi", max_tokens=0), 400, "invalid_value"),
    "max_tokens past the context": (chat("Hi", max_tokens=100000), 400, "context_length_exceeded"),
    "messages of the wrong type": ({"messages": "hello"}, 400, "invalid_value"),
    "temperature of the wrong type": (chat("Hi", temperature="hot"), 400, "invalid_value"),
    "temperature out of range": (chat("Hi", temperature=7), 400, "invalid_value"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "invalid_value"),
    "no messages": ({"messages": []}, 400, "invalid_value"),
    "n above 1": (chat("Hi", n=2), 400, "invalid_value"),
    "unknown content part": (chat([{"type": "audio", "audio": "..."}]), 400, "invalid_value"),
}


def assert_error_shape(response, status, code):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["message"] and error["type"]
    # The error names its request, as the response's header does: what the journal is searched by.
    assert error["request_id"] == response.headers["x-request-id"]
    assert error["code"] == code, error


@pytest.mark.parametrize("name", list(CORPUS))
def test_bad_chat_request(server, name):
    body, status, code = CORPUS[name]
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert_error_shape(response, status, code)


def test_invalid_json(server):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"messages": [',
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert_error_shape(response, 400, "invalid_value")
    assert "not valid JSON" in response.json()["error"]["message"]


def test_body_over_the_upload_limit_gets_413(server):
    body = json.dumps(image_url(data_uri(b"\0" * TOO_BIG_BODY))).encode()
    response = httpx.post(
        server.url + "/v1/chat/completions", content=body, timeout=60, headers={"Content-Type": "application/json"}
    )
    assert_error_shape(response, 413, "request_too_large")


def test_multipart_upload_over_the_limit_gets_413(server):
    response = httpx.post(
        server.url + "/v1/ask",
        files={"image": ("big.png", b"\0" * TOO_BIG_BODY, "image/png")},
        data={"question": "What?"},
        timeout=60,
    )
    assert_error_shape(response, 413, "request_too_large")


def test_multipart_without_an_image_or_with_a_broken_one(server):
    assert_error_shape(httpx.post(server.url + "/v1/ask", data={"question": "What?"}, timeout=30), 400, "invalid_value")
    broken = httpx.post(
        server.url + "/v1/ask",
        files={"image": ("x.jpg", jpeg_bytes()[:500], "image/jpeg")},
        data={"question": "What?"},
        timeout=30,
    )
    assert_error_shape(broken, 400, "invalid_image")


def test_unknown_path_has_the_error_shape(server):
    assert_error_shape(httpx.get(server.url + "/v1/nothing-here"), 404, None)


def test_after_the_whole_corpus_the_worker_answers_and_memory_is_back(server):
    good = image_question(png_bytes(), max_tokens=4)
    assert httpx.post(server.url + "/v1/chat/completions", json=good, timeout=60).status_code == 200
    before = server.rss()
    for _ in range(3):
        for body, _, _ in CORPUS.values():
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    after = server.rss()
    response = httpx.post(server.url + "/v1/chat/completions", json=good, timeout=60)
    assert response.status_code == 200
    assert after - before < 64 * 2**20, "resident memory grew by %.0f MiB" % ((after - before) / 2**20)
