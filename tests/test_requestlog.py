"""Request IDs end to end in one worker: the ID a client sends (when valid) or one the worker makes
comes back in the header, in every error body and in the record the worker writes when the request
ends; under systemd that record is a journal entry with structured fields (its datagram is checked
here on a real socket; the deploy tier finds it with journalctl on a real host)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from sample_images import chat
from vlserve.api.requestlog import Journal, RequestLogMiddleware, stderr_is_the_journal
from vlserve.sizing.contract import REQUEST_ID


def post(server, body, **kwargs):
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120, **kwargs)


def record_in_log(server, request_id: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in Path(server.log.name).read_text(errors="replace").splitlines():
            if "request %s:" % request_id in line:
                return line
        time.sleep(0.2)
    raise AssertionError("no record of request %s in the worker's log" % request_id)


def test_a_valid_id_is_kept_an_invalid_one_replaced_and_the_record_names_it(server):
    sent = "client-trace-0001"
    answered = post(server, chat("Name a colour.", max_tokens=4), headers={"X-Request-Id": sent})
    assert answered.status_code == 200 and answered.headers["x-request-id"] == sent
    line = record_in_log(server, sent)
    assert re.search(
        r"POST /v1/chat/completions 200 in \d+ ms, client none, first token after \d+ ms, \d+\+[1-4] tokens", line
    ), line

    for invalid in ("short", "has a space in it", "x" * 129, "semi;colon-0001"):
        made = post(server, chat("Hi", max_tokens=2), headers={"X-Request-Id": invalid}).headers["x-request-id"]
        assert made != invalid and re.fullmatch(r"[0-9a-f]{32}", made) and re.match(REQUEST_ID, made)

    refused = post(server, chat("Hi", max_tokens=0))
    assert refused.status_code == 400
    assert refused.json()["error"]["request_id"] == refused.headers["x-request-id"]
    assert " 400 in " in record_in_log(server, refused.headers["x-request-id"])


def test_a_streamed_answer_is_recorded_when_its_stream_ends(server):
    body = chat("Count to three.", max_tokens=3, stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        text = response.read().decode()
    assert response.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    line = record_in_log(server, response.headers["x-request-id"])
    assert re.search(r"first token after \d+ ms, \d+\+[1-3] tokens", line), line


def read_fields(datagram: bytes) -> dict[str, str]:
    """The journal's native protocol, read back: KEY=value lines, or KEY, newline, length, bytes."""
    fields, at = {}, 0
    while at < len(datagram):
        end = datagram.index(b"\n", at)
        line = datagram[at:end]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            at = end + 1
        else:
            (size,) = struct.unpack("<Q", datagram[end + 1 : end + 9])
            key, value = line, datagram[end + 9 : end + 9 + size]
            at = end + 9 + size + 1
        fields[key.decode()] = value.decode()
    return fields


@pytest.fixture
def journal_socket(tmp_path):
    path = tmp_path / "journal.socket"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(5)
    yield path, listener
    listener.close()


async def answer(request):
    return PlainTextResponse("ok", status_code=int(request.query_params.get("status", "200")))


def test_the_record_is_a_journal_entry_with_structured_fields(journal_socket):
    path, listener = journal_socket
    app = RequestLogMiddleware(Starlette(routes=[Route("/v1/x", answer)]), Journal(str(path), enabled=True))
    transport = httpx.ASGITransport(app=app)

    async def ask():
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            await client.get("/v1/x", headers={"X-Request-Id": "deploy-check-42"})
            await client.get("/v1/x?status=503")
            await client.get("/healthz")  # not an API request: no record

    asyncio.run(ask())
    first, second = (read_fields(listener.recv(65536)) for _ in range(2))
    assert first["REQUEST_ID"] == "deploy-check-42" and first["REQUEST_STATUS"] == "200"
    assert first["PRIORITY"] == "6" and first["SYSLOG_IDENTIFIER"] == "vlserve"
    assert first["MESSAGE"].startswith("request deploy-check-42: GET /v1/x 200 in ")
    assert second["REQUEST_STATUS"] == "503" and second["PRIORITY"] == "4"
    listener.settimeout(0.3)
    with pytest.raises(TimeoutError):
        listener.recv(65536)


def test_a_value_with_a_newline_goes_in_the_binary_form():
    fields = {"MESSAGE": "two\nlines", "REQUEST_ID": "abcdefgh"}
    assert read_fields(Journal.encode(fields)) == fields
    assert b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n" in Journal.encode(fields)


def test_only_the_stream_systemd_connected_counts_as_the_journal(monkeypatch, tmp_path):
    stat = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", "%d:%d" % (stat.st_dev, stat.st_ino))
    assert stderr_is_the_journal()
    monkeypatch.setenv("JOURNAL_STREAM", "%d:%d" % (stat.st_dev, stat.st_ino + 1))
    assert not stderr_is_the_journal()
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert not stderr_is_the_journal()
    monkeypatch.delenv("JOURNAL_STREAM")
    assert not stderr_is_the_journal()
