"""One error shape for every failure, `{"error": {"message", "type", "param", "code"}}`, and the
typed handlers that map each kind of failure to its status: bad input 4xx, overload 429/503 with
Retry-After, engine failure 503, everything else 500 and logged."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlserve.api.protocol import ErrorDetail, ErrorResponse
from vlserve.api.requestlog import trace_of
from vlserve.errors import EngineError, InvalidRequest, NotReady, Overloaded, RequestTimeout
from vlserve.runtime.images import ImageError

log = logging.getLogger("vlserve")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self, request_id: str | None = None) -> ErrorResponse:
        detail = ErrorDetail(
            message=self.message, type=self.type, param=self.param, code=self.code, request_id=request_id
        )
        return ErrorResponse(error=detail)


def not_ready(state: str) -> APIError:
    return APIError(503, "the model is %s" % state, "service_unavailable", code="not_ready", retry_after=5)


def error_response(error: APIError, state: Any = None) -> JSONResponse:
    """The error's response; `state` (a request's state or an ASGI scope's) names the request."""
    trace = trace_of(state) if state is not None else None
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    body = error.body(trace.request_id if trace is not None else None)
    return JSONResponse(body.model_dump(), status_code=error.status, headers=headers)


def from_engine_error(error: EngineError) -> APIError:
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error), "invalid_request_error", param=error.param, code=error.code)
    if isinstance(error, Overloaded):
        status = 503 if error.code == "memory_pressure" else 429
        return APIError(status, str(error), "overloaded_error", code=error.code, retry_after=error.retry_after)
    if isinstance(error, NotReady):
        return APIError(503, str(error), "service_unavailable", code=error.code, retry_after=5)
    if isinstance(error, RequestTimeout):
        return APIError(504, str(error), "timeout_error", code=error.code)
    return APIError(503, str(error), "engine_error", code=error.code, retry_after=5)


def from_image_error(error: ImageError) -> APIError:
    if error.status == 413:
        return APIError(413, str(error), "invalid_request_error", param=error.param, code="image_too_large")
    return APIError(400, str(error), "invalid_request_error", param=error.param, code="invalid_image")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return "%s%s" % ("%s: " % param if param else "", first.get("msg", "invalid request")), param


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(error, request.state)


async def _engine_error(request: Request, error: EngineError) -> JSONResponse:
    return error_response(from_engine_error(error), request.state)


async def _image_error(request: Request, error: ImageError) -> JSONResponse:
    return error_response(from_image_error(error), request.state)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(error)
    return error_response(
        APIError(400, message, "invalid_request_error", param=param, code="invalid_value"), request.state
    )


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(APIError(error.status_code, str(error.detail), kind), request.state)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(APIError(500, "internal error: %s" % type(error).__name__, "server_error"), request.state)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves as the one error shape; engine and image errors need no try/except in routes."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(ImageError, _image_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
