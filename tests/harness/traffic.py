"""A client that keeps asking a front while a play changes what stands behind it."""

from __future__ import annotations

import threading
import time
import typing

import httpx

# One request sent every this many seconds, at most. Sent back to back they were ~30 a second in the
# fleet tier (each a new TLS connection through two fronts to a worker): about a core of the two,
# taken from the plays the tests time. Five a second still puts dozens of requests into each drain
# and restart, the windows a lost request would fall in.
INTERVAL_S = 0.2


class Outcome(typing.NamedTuple):
    sent: float  # when it was sent (time.time()): a request routed just before a drain is answered after it
    status: int | str  # the HTTP status, or the name of the transport error
    host: str | None  # which host answered (x-vlserve-host), where a front says


class Traffic(threading.Thread):
    """Calls `send` (one request, returning its response) every INTERVAL_S until stopped, or for at
    most `limit_s`, and keeps every outcome."""

    def __init__(self, send: typing.Callable[[], httpx.Response], limit_s: float = 1200):
        super().__init__(daemon=True)
        self.send, self.limit_s = send, limit_s
        self.outcomes: list[Outcome] = []
        self.stopped = threading.Event()

    def run(self):
        deadline = time.monotonic() + self.limit_s
        while not self.stopped.is_set() and time.monotonic() < deadline:
            started, sent = time.monotonic(), time.time()
            try:
                response = self.send()
                self.outcomes.append(Outcome(sent, response.status_code, response.headers.get("x-vlserve-host")))
            except httpx.HTTPError as error:
                self.outcomes.append(Outcome(sent, type(error).__name__, None))
            self.stopped.wait(INTERVAL_S - (time.monotonic() - started))

    def stop(self) -> list[Outcome]:
        self.stopped.set()
        self.join(90)
        return self.outcomes
