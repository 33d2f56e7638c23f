"""The HTTP API of one worker on the tiny model: the real transformers path end to end."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import math
import pathlib
import threading
import time

import httpx
import openai
import pytest

from conftest import Server
from sample_images import chat, data_uri, image_question, jpeg_bytes, png_bytes
from vlserve.kernels import native
from vlserve.sizing import contract
from vlserve.sizing.certificates import not_after


def post(server, body, **kwargs):
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120, **kwargs)


def test_chat_completion_with_an_image(server):
    response = post(server, image_question(png_bytes(), max_tokens=8, temperature=0))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "qwen3-vl-2b-instruct"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    # 320x240 at the tiny model's 128x128 cap: 4x3 merged patches = 12 image tokens plus the chat text.
    assert usage["prompt_tokens"] > 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 8
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8


def test_text_only_and_system_prompt(server):
    body = {
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello?"}],
        "max_completion_tokens": 5,
        "temperature": 0,
    }
    response = post(server, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 5


def test_streaming_matches_the_whole_answer(server):
    body = image_question(jpeg_bytes(), "Describe it.", mime="image/jpeg", max_tokens=12, temperature=0, seed=1)
    whole = post(server, body).json()
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=120,
        json=dict(body, stream=True, stream_options={"include_usage": True}),
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == dict(whole["usage"], answer_from_cache=True)
    assert not whole["usage"]["answer_from_cache"]  # the same greedy request again: from the result cache


def test_multipart_ask(server):
    response = httpx.post(
        server.url + "/v1/ask",
        timeout=120,
        files={"image": ("photo.jpg", jpeg_bytes(), "image/jpeg")},
        data={"question": "What is in this photo?", "max_tokens": "6"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["answer"], str) and body["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 6


def test_models_and_health(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-vl-2b-instruct"
    assert models["data"][0]["max_model_len"] == 4096
    assert httpx.get(server.url + "/healthz").json()["status"] == "alive"
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["status"] == "ready"
    assert ready["quantize"] == "none"
    bf16_kernel = native.cpu_tier()[0] == "avx512_vnni" and native.BF16_FLAG in (native._cpu_flags() or [])
    if bf16_kernel:  # bfloat16 decodes on them
        assert ready["kernels"].startswith("vlserve's kernels for AVX-512 VNNI (bf16/int8/int4"), ready["kernels"]
        assert ready["packed_weights"]  # the plan's choice, in the layout of vlserve's product
    else:
        assert ready["kernels"] == native.STOCK


def test_the_official_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    image = {"type": "image_url", "image_url": {"url": data_uri(png_bytes(color=(0, 200, 0)))}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What color is it?"}]}]
    completion = client.chat.completions.create(model="qwen3-vl-2b-instruct", messages=messages, max_tokens=6)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model="qwen3-vl-2b-instruct",
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == completion.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    assert [m.id for m in client.models.list()] == ["qwen3-vl-2b-instruct"]


def test_eight_parallel_clients_are_batched_and_all_complete(server):
    before = server.metrics()
    bodies = [
        image_question(
            png_bytes(color=(30 * i, 90, 200 - 20 * i)), "Question %d?" % i, max_tokens=64, temperature=0.8, seed=i
        )
        for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda body: post(server, body), bodies))
    for response in responses:
        assert response.status_code == 200, response.text
        body = response.json()
        reason, tokens = body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
        assert reason == "stop" or tokens == 64, (reason, tokens)
    after = server.metrics()
    steps = after[("vlserve_decode_batch_size_count", ())] - before.get(("vlserve_decode_batch_size_count", ()), 0)
    total = after[("vlserve_decode_batch_size_sum", ())] - before.get(("vlserve_decode_batch_size_sum", ()), 0)
    assert total / steps > 1.5, "decode steps averaged %.2f sequences: requests were not batched" % (total / steps)


def test_caches_hit_for_a_repeated_request_a_second_question_and_the_same_image_elsewhere(server):
    image = png_bytes(size=(200, 200), color=(10, 20, 30))
    before = server.metrics()
    first = post(server, image_question(image, "What is it?", max_tokens=6, temperature=0)).json()
    again = post(server, image_question(image, "What is it?", max_tokens=6, temperature=0)).json()
    other = post(server, image_question(image, "And the colors?", max_tokens=6, temperature=0))
    assert other.status_code == 200
    # The image after a question: no stored prefix holds it, the vision cache does.
    parts = [{"type": "text", "text": "Look at this:"}, {"type": "image_url", "image_url": {"url": data_uri(image)}}]
    later = post(server, chat(parts, max_tokens=6, temperature=0))
    assert later.status_code == 200
    after = server.metrics()

    def delta(name, cache):
        key = (name, (("cache", cache),))
        return after[key] - before.get(key, 0)

    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"] == dict(first["usage"], answer_from_cache=True)
    assert first["usage"]["images"] == 1 and first["usage"]["images_from_cache"] == 0
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # The second question: the first's keys and values up to the question (the image's tokens
    # included), so its image was neither encoded nor looked up.
    usage = other.json()["usage"]
    assert usage["images_from_cache"] == 1 and not usage["answer_from_cache"]
    assert usage["image_tokens"] < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert later.json()["usage"]["images_from_cache"] == 1
    assert later.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert delta("vlserve_cache_hits_total", "result") == 1
    assert delta("vlserve_cache_misses_total", "result") == 3
    assert delta("vlserve_cache_hits_total", "prefix") == 1 and delta("vlserve_cache_misses_total", "prefix") == 2
    assert delta("vlserve_cache_misses_total", "vision") == 1  # the first request encoded the image
    assert delta("vlserve_cache_hits_total", "vision") == 1  # the image after a question reused it
    cached = after[("vlserve_prompt_tokens_cached_total", ())] - before.get(
        ("vlserve_prompt_tokens_cached_total", ()), 0
    )
    assert cached == usage["prompt_tokens_details"]["cached_tokens"]


def test_metrics_parse_and_count_outcomes(server):
    post(server, {"messages": []})
    samples = server.metrics()
    names = {name for name, _ in samples}
    for expected in (
        "vlserve_requests_total",
        "vlserve_queue_depth",
        "vlserve_time_to_first_token_seconds_bucket",
        "vlserve_time_per_output_token_seconds_bucket",
        "vlserve_e2e_request_latency_seconds_bucket",
        "vlserve_generated_tokens_total",
        "vlserve_image_encode_seconds_bucket",
        "vlserve_resident_memory_bytes",
        "vlserve_ready",
        "process_resident_memory_bytes",
    ):
        assert expected in names, expected
    assert samples[("vlserve_requests_total", (("endpoint", "/v1/chat/completions"), ("outcome", "client_error")))] >= 1
    assert samples[("vlserve_ready", ())] == 1.0
    # Which kernels run, as /readyz says it; the cgroup's memory and limits, as the kernel reports them
    # for this process (NaN where there is no cgroup v2 to read, +Inf for a limit that is not set).
    kernels = httpx.get(server.url + "/readyz", timeout=10).json()["kernels"]
    assert samples[("vlserve_own_kernels", ())] == (1.0 if kernels.startswith(contract.KERNELS_OWN) else 0.0)
    cgroup = pathlib.Path("/sys/fs/cgroup") / next(
        line[3:] for line in pathlib.Path("/proc/%d/cgroup" % server.process.pid).read_text().splitlines()
        if line.startswith("0::")
    ).lstrip("/")  # fmt: skip
    for name, file in (("high", "memory.high"), ("max", "memory.max")):
        written = (cgroup / file).read_text().strip() if (cgroup / file).exists() else None
        value = samples[("vlserve_cgroup_memory_%s_bytes" % name, ())]
        assert value == (math.inf if written == "max" else float(written)) if written else math.isnan(value)
    assert samples[("vlserve_cgroup_memory_bytes", ())] > 0 or not (cgroup / "memory.current").exists()
    # The host front's certificate where this machine has one, else NaN (never a made-up date).
    certificate = pathlib.Path(contract.FRONT_PUBLIC_CERTIFICATE)
    end = samples[("vlserve_certificate_not_after_seconds", (("path", str(certificate)),))]
    if certificate.exists():
        assert end == not_after(certificate.read_text())
    else:
        assert math.isnan(end)


@pytest.fixture(scope="module")
def narrow_server(tiny_model):
    """One batch slot and no queue: the second concurrent request is refused."""
    running = Server(
        tiny_model,
        "--max-batch-size",
        "1",
        "--max-queue",
        "0",
        "--api-key",
        "s3cret",
        "--image-url-hosts",
        "127.0.0.1",
        "--image-fetch-timeout-s",
        "2",
        "--max-upload-bytes",
        str(2 * 2**20),
    ).wait_ready()
    yield running
    running.stop()


def test_queue_overflow_gets_429_with_retry_after(narrow_server):
    auth = {"Authorization": "Bearer s3cret"}
    long_request = image_question(png_bytes(), max_tokens=3000, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", narrow_server.url + "/v1/chat/completions", json=long_request, headers=auth, timeout=120
    ) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept referenced: a collected iterator would close the stream
        for line in lines:  # the first text: the request holds the only slot now
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        refused = post(narrow_server, image_question(png_bytes(), max_tokens=4), headers=auth)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    # The stream was abandoned: its work is cancelled, the slot frees up and the worker answers again.
    deadline = time.monotonic() + 10
    while (status := post(narrow_server, image_question(png_bytes(), max_tokens=4), headers=auth).status_code) == 429:
        assert time.monotonic() < deadline, "the abandoned stream still holds the slot"
        time.sleep(0.2)
    assert status == 200
    assert narrow_server.metrics()[("vlserve_cancelled_requests_total", ())] >= 1


def test_api_key_is_required_when_set(narrow_server):
    response = post(narrow_server, image_question(png_bytes(), max_tokens=2))
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(narrow_server.url + "/healthz").status_code == 200  # health stays open


class ImageHost(http.server.BaseHTTPRequestHandler):
    """A loopback web server with one good image, one too large, a redirect and a slow one."""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(4)
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return
        body = png_bytes() if self.path in ("/ok.png", "/slow.png") else b"\0" * (3 * 2**20)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % host.server_address[1]
    host.shutdown()


@pytest.mark.parametrize(
    "path, status, code",
    [
        ("/ok.png", 200, None),
        ("/big.png", 413, "image_too_large"),
        ("/redirect.png", 400, "invalid_image"),
        ("/slow.png", 400, "invalid_image"),
    ],
)
def test_image_urls_from_an_allowed_host(narrow_server, image_host, path, status, code):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_host + path}},
                    {"type": "text", "text": "What?"},
                ],
            }
        ],
        "max_tokens": 3,
    }
    response = post(narrow_server, body, headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == status, response.text
    if code:
        assert response.json()["error"]["code"] == code
