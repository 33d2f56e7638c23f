"""Each request's ID and its one log record.

The ID is the X-Request-Id the front set (or a valid one the client sent when the worker is reached
directly), or one made here. It goes back in the response's header and in every error body, and it
names the record the worker writes when an API request ends: status, client, time to first token and
tokens, as structured fields of the systemd journal, so `journalctl -u 'vlserve@*' REQUEST_ID=<id>`
finds it. Outside the journal (a terminal, a container) the record is a log line.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlserve.sizing.contract import REQUEST_ID, REQUEST_ID_HEADER

log = logging.getLogger("vlserve.requests")

JOURNAL_SOCKET = "/run/systemd/journal/socket"
_HEADER = REQUEST_ID_HEADER.lower().encode()


@dataclass
class RequestTrace:
    """What the record of one request says; the middleware and the submission fill it in."""

    request_id: str
    path: str
    method: str
    started: float = field(default_factory=time.monotonic)
    client: str | None = None
    status: int | None = None
    first_token_at: float | None = None
    usage: Any = None

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def fields(self, ended: float) -> dict[str, str]:
        """The journal fields: upper-case names, one REQUEST_ prefix."""
        record = {
            "REQUEST_ID": self.request_id,
            "REQUEST_METHOD": self.method,
            "REQUEST_PATH": self.path,
            "REQUEST_STATUS": str(self.status if self.status is not None else 500),
            "REQUEST_CLIENT": self.client or "",
            "REQUEST_DURATION_MS": "%.0f" % ((ended - self.started) * 1000),
        }
        if self.first_token_at is not None:
            record["REQUEST_TTFT_MS"] = "%.0f" % ((self.first_token_at - self.started) * 1000)
        if self.usage is not None:
            record["REQUEST_PROMPT_TOKENS"] = str(self.usage.prompt_tokens)
            record["REQUEST_COMPLETION_TOKENS"] = str(self.usage.completion_tokens)
        return record


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's ID if it is one the fronts would keep, else a new one."""
    sent = headers.get(_HEADER, b"").decode("latin-1")
    return sent if re.match(REQUEST_ID, sent) else uuid.uuid4().hex


def message(record: dict[str, str]) -> str:
    ttft = record.get("REQUEST_TTFT_MS")
    return "request %s: %s %s %s in %s ms%s%s%s" % (
        record["REQUEST_ID"],
        record["REQUEST_METHOD"],
        record["REQUEST_PATH"],
        record["REQUEST_STATUS"],
        record["REQUEST_DURATION_MS"],
        ", client %s" % record["REQUEST_CLIENT"] if record["REQUEST_CLIENT"] else "",
        ", first token after %s ms" % ttft if ttft else "",
        ", %s+%s tokens" % (record["REQUEST_PROMPT_TOKENS"], record["REQUEST_COMPLETION_TOKENS"])
        if "REQUEST_PROMPT_TOKENS" in record
        else "",
    )


def stderr_is_the_journal() -> bool:
    """systemd's rule: JOURNAL_STREAM names the device and inode of the stream it connected; it holds
    only while stderr is still that stream (a child whose output was redirected inherits the variable)."""
    try:
        device, inode = (int(part) for part in os.environ.get("JOURNAL_STREAM", "").split(":"))
        stat = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


class Journal:
    """Writes records to the systemd journal over its native protocol (one datagram per record, as
    sd_journal_send does) when this process's output goes to the journal; otherwise to the log."""

    def __init__(self, path: str = JOURNAL_SOCKET, enabled: bool | None = None):
        self.path = path
        self.enabled = (stderr_is_the_journal() and os.path.exists(path)) if enabled is None else enabled
        self._socket: socket.socket | None = None

    @staticmethod
    def encode(fields: dict[str, str]) -> bytes:
        """KEY=value lines; a value with a newline in it goes as KEY, newline, 64-bit length, bytes."""
        out = bytearray()
        for key, value in fields.items():
            data = value.encode()
            if b"\n" in data:
                out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
            else:
                out += key.encode() + b"=" + data + b"\n"
        return bytes(out)

    def send(self, record: dict[str, str], priority: int) -> None:
        text = message(record)
        if self.enabled:
            fields = {"MESSAGE": text, "PRIORITY": str(priority), "SYSLOG_IDENTIFIER": "vlserve", **record}
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.sendto(self.encode(fields), self.path)
                return
            except OSError as error:  # the journal went away: say so once, then log lines
                self.enabled = False
                log.warning("cannot write to the journal at %s (%s): request records go to the log", self.path, error)
        log.log(logging.WARNING if priority <= 4 else logging.INFO, "%s", text)


class RequestLogMiddleware:
    """Outermost: gives every request its ID (scope state `trace`), puts X-Request-Id on every
    response, and writes the record of each /v1/ request once its last byte is sent."""

    def __init__(self, app, journal: Journal):
        self.app, self.journal = app, journal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = RequestTrace(request_id(dict(scope.get("headers") or [])), scope["path"], scope["method"])
        scope.setdefault("state", {})["trace"] = trace

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                trace.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (_HEADER, trace.request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if scope["path"].startswith("/v1/"):
                status = trace.status if trace.status is not None else 500
                self.journal.send(trace.fields(time.monotonic()), 4 if status >= 500 else 6)


def trace_of(scope_state: Any) -> RequestTrace | None:
    """The trace in a request's state, where the middleware put one."""
    return getattr(scope_state, "trace", None) if not isinstance(scope_state, dict) else scope_state.get("trace")
