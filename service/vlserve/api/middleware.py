"""ASGI middleware: the request body limit (413 before the body is read) and the request counter."""

from __future__ import annotations

from fastapi import Request

from vlserve.api.errors import APIError, error_response
from vlserve.runtime.metrics import Metrics
from vlserve.sizing.contract import CLIENT_HEADER


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse bodies over the limit with 413: by Content-Length at once, or while they stream in."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = APIError(
            413, "the request body is over %d bytes" % self.limit, "invalid_request_error", code="request_too_large"
        )
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(too_large, scope.get("state"))(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await error_response(too_large, scope.get("state"))(scope, receive, send)


def outcome(status: int) -> str:
    """The `outcome` label of vlserve_requests_total for an HTTP status."""
    if status < 400:
        return "ok"
    if status == 429:
        return "overloaded"
    if status < 500:
        return "client_error"
    return {503: "unavailable", 504: "timeout"}.get(status, "error")


def request_counter(metrics: Metrics):
    """Count every /v1/ request by its route and outcome, and by the API client the front named."""

    async def count_requests(request: Request, call_next):
        client = metrics.client_label(request.headers.get(CLIENT_HEADER))
        request.state.trace.client = client
        response = await call_next(request)
        endpoint = getattr(request.scope.get("route"), "path", "unmatched")
        if endpoint.startswith("/v1/"):
            metrics.requests.labels(endpoint, outcome(response.status_code)).inc()
            metrics.client_requests.labels(client, outcome(response.status_code)).inc()
        return response

    return count_requests
