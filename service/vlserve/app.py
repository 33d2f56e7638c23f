"""The HTTP layer: an app factory, its lifespan, the routes and one error shape for every failure.

Knows nothing of torch: it turns requests into the engine's inputs (messages with decoded images,
sampling parameters) and the engine's events into OpenAI-shaped responses and server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlserve import notify
from vlserve.engine import (
    Engine,
    EngineError,
    InvalidRequest,
    ModelDirectoryError,
    NotReady,
    Overloaded,
    RequestTimeout,
    Usage,
)
from vlserve.images import ImageError, decode_data_uri, fetch_image_url, load_image
from vlserve.metrics import Metrics
from vlserve.protocol import (
    AskResponse,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    completion_id,
)
from vlserve.sampling import SamplingParams
from vlserve.settings import Settings

log = logging.getLogger("vlserve")


# --- errors: one shape ---------------------------------------------------------------------


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


def error_response(error: APIError) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=error.message, type=error.type, param=error.param, code=error.code))
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
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


# --- the body size limit -------------------------------------------------------------------


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
            await error_response(too_large)(scope, receive, send)
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
                await error_response(too_large)(scope, receive, send)


# --- bridging the scheduler thread to asyncio ---------------------------------------------


class QueueSink:
    """Engine sink that hands events to an asyncio queue, from whatever thread calls it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def _put(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_text(self, text: str) -> None:
        self._put(("text", text))

    def on_finish(self, reason: str, usage: Usage) -> None:
        self._put(("finish", (reason, usage)))

    def on_error(self, error: EngineError) -> None:
        self._put(("error", error))


def _usage(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
    )


# --- the app -------------------------------------------------------------------------------


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def create_app(
    settings: Settings, engine: Engine | None = None, on_fatal: Callable[[str], None] | None = None
) -> FastAPI:
    """The service for one worker. The engine loads in the background: /healthz answers at once,
    /readyz only after the model is loaded and warmed up."""
    metrics = engine.metrics if engine is not None else Metrics()
    engine = engine or Engine(settings.model, settings.limits, metrics)
    prep_limiter = anyio.CapacityLimiter(2)  # image decoding and tokenizing: few threads, off the event loop

    def load_in_background() -> None:
        try:
            engine.load(status=notify.status)
            if settings.model.warmup:
                engine.warmup(status=notify.status)
            engine.mark_ready()
            notify.ready(
                "ready: %s, %s%s, %d threads"
                % (settings.server.served_model_name, engine.dtype, " packed" if engine.packed else "", engine.threads)
            )
            log.info("ready on %s:%d", settings.server.host, settings.server.port)
        except Exception as error:
            engine.state = "failed"
            message = "model load failed: %s" % error
            if isinstance(error, ModelDirectoryError):
                message = str(error)
            log.error("%s", message, exc_info=not isinstance(error, ModelDirectoryError))
            notify.status(message)
            app.state.fatal = message
            if on_fatal is not None:
                on_fatal(message)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = threading.Thread(target=load_in_background, name="vlserve-loader", daemon=True)
        loader.start()
        try:
            yield
        finally:
            notify.send("STOPPING=1")
            await anyio.to_thread.run_sync(engine.shutdown)

    app = FastAPI(title="vlserve", version=__import__("vlserve").__version__, lifespan=lifespan)
    app.state.engine, app.state.settings, app.state.metrics, app.state.fatal = engine, settings, metrics, None
    app.add_middleware(BodyLimitMiddleware, limit=settings.limits.max_upload_bytes)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        if endpoint.startswith("/v1/"):
            status = response.status_code
            outcome = (
                "ok"
                if status < 400
                else "overloaded"
                if status == 429
                else "client_error"
                if status < 500
                else "unavailable"
                if status == 503
                else "timeout"
                if status == 504
                else "error"
            )
            metrics.requests.labels(endpoint, outcome).inc()
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return error_response(APIError(400, message, "invalid_request_error", param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(APIError(error.status_code, str(error.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal error: %s" % type(error).__name__, "server_error"))

    async def authorize(request: Request) -> None:
        key = settings.server.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if given != "Bearer " + key.get_secret_value():
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
                code="invalid_api_key",
            )

    def require_ready() -> None:
        if not engine.ready:
            raise APIError(
                503, "the model is %s" % engine.state, "service_unavailable", code="not_ready", retry_after=5
            )

    # -- health and metrics --------------------------------------------------------------

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"status": "alive", "model_state": engine.state}

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        if engine.ready:
            return {
                "status": "ready",
                "queue_depth": engine.queue_depth,
                "running": engine.running,
                "dtype": engine.dtype,
                "vision_dtype": engine.vision_dtype,
                "prefill_dtype": engine.prefill_dtype,
                "prefill_copies_pending": engine.prefill_copies_pending,
                "background_steps_pending": engine.background_steps_pending,
                "threads": engine.threads,
                "packed_weights": engine.packed,
            }
        return error_response(
            APIError(503, "the model is %s" % engine.state, "service_unavailable", code="not_ready", retry_after=5)
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- the API -------------------------------------------------------------------------

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=settings.server.served_model_name,
                    created=int(app.state.started),
                    max_model_len=settings.limits.max_context_tokens,
                )
            ]
        )

    async def resolve_image(url: str, param: str) -> bytes:
        if url.startswith("data:"):
            return decode_data_uri(url, param)
        return await fetch_image_url(
            url,
            settings.limits.image_url_hosts,
            settings.limits.image_fetch_timeout_s,
            settings.limits.max_upload_bytes,
            param,
        )

    def decode(data: bytes, param: str):
        return load_image(data, settings.limits.max_image_source_pixels, settings.model.max_pixels, param)

    async def run_prepared(build: Callable[[], Any]):
        try:
            return await anyio.to_thread.run_sync(build, limiter=prep_limiter)
        except ImageError as error:
            raise from_image_error(error) from None
        except EngineError as error:
            raise from_engine_error(error) from None

    async def conversation(body: ChatCompletionRequest):
        """Messages in the engine's form; image bytes fetched here, decoded in a worker thread."""
        count = sum(
            1 for m in body.messages if not isinstance(m.content, str) for p in m.content if p.type == "image_url"
        )
        if count > settings.limits.max_images_per_request:
            raise APIError(
                400,
                "%d images in one request; the limit is %d" % (count, settings.limits.max_images_per_request),
                "invalid_request_error",
                param="messages",
                code="too_many_images",
            )
        raw: list[dict[str, Any]] = []
        for m_index, message in enumerate(body.messages):
            if isinstance(message.content, str):
                raw.append({"role": message.role, "content": message.content})
                continue
            parts = []
            for p_index, part in enumerate(message.content):
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                else:
                    param = "messages.%d.content.%d.image_url" % (m_index, p_index)
                    try:
                        parts.append(
                            {"type": "image", "bytes": await resolve_image(part.image_url.url, param), "param": param}
                        )
                    except ImageError as error:
                        raise from_image_error(error) from None
            raw.append({"role": message.role, "content": parts})

        def build():
            messages = []
            for message in raw:
                content = message["content"]
                if not isinstance(content, str):
                    content = [
                        {"type": "image", "image": decode(part["bytes"], part["param"])}
                        if part["type"] == "image"
                        else part
                        for part in content
                    ]
                messages.append({"role": message["role"], "content": content})
            return engine.prepare(messages)

        return await run_prepared(build)

    def sampling(body: ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        defaults = engine.sampling_defaults()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else defaults["temperature"],
            top_p=body.top_p if body.top_p is not None else defaults["top_p"],
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )

    def submit(prompt, params: SamplingParams, sink: QueueSink):
        try:
            return engine.submit(prompt, params, sink)
        except EngineError as error:
            raise from_engine_error(error) from None

    async def collect(request: Request, sequence, sink: QueueSink) -> tuple[str, str, Usage]:
        """Wait for the whole answer; cancel the work if the client goes away."""
        pieces = []
        while True:
            try:
                kind, payload = await asyncio.wait_for(sink.queue.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    sequence.cancel()
                    raise APIError(499, "client closed the request", "invalid_request_error") from None
                continue
            if kind == "text":
                pieces.append(payload)
            elif kind == "finish":
                return "".join(pieces), payload[0], payload[1]
            else:
                raise from_engine_error(payload)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        require_ready()
        prompt = await conversation(body)
        try:
            max_tokens = engine.resolve_max_tokens(prompt, body.requested_max_tokens())
        except EngineError as error:
            raise from_engine_error(error) from None
        sink = QueueSink(asyncio.get_running_loop())
        sequence = submit(prompt, sampling(body, max_tokens), sink)
        model_name = settings.server.served_model_name
        if not body.stream:
            text, reason, usage = await collect(request, sequence, sink)
            return ChatCompletion(
                model=model_name,
                choices=[Choice(message=AssistantMessage(content=text), finish_reason=reason)],
                usage=_usage(usage),
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream_chunks(sequence, sink, model_name, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream_chunks(sequence, sink: QueueSink, model_name: str, include_usage: bool):
        chunk_id, created = completion_id(), int(time.time())

        def event(choices: list[ChunkChoice], usage: UsageInfo | None = None) -> str:
            chunk = ChatCompletionChunk(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)
            return "data: %s\n\n" % chunk.model_dump_json(exclude_none=False)

        try:
            yield event([ChunkChoice(delta=Delta(role="assistant", content=""))])
            while True:
                kind, payload = await sink.queue.get()
                if kind == "text":
                    yield event([ChunkChoice(delta=Delta(content=payload))])
                elif kind == "finish":
                    reason, usage = payload
                    yield event([ChunkChoice(delta=Delta(), finish_reason=reason)])
                    if include_usage:
                        yield event([], _usage(usage))
                    break
                else:
                    api_error = from_engine_error(payload)
                    body = ErrorResponse(
                        error=ErrorDetail(message=api_error.message, type=api_error.type, code=api_error.code)
                    )
                    yield "data: %s\n\n" % body.model_dump_json()
                    break
            yield "data: [DONE]\n\n"
        finally:
            # Reached on normal end too, where cancel() is a no-op; on a disconnect it frees the batch slot.
            sequence.cancel()

    @app.post("/v1/ask", dependencies=[Depends(authorize)])
    async def ask(
        request: Request,
        image: UploadFile = File(description="the image"),  # noqa: B008 - FastAPI's way of declaring form fields
        question: str = Form(min_length=1),
        max_tokens: int | None = Form(None, ge=1),
        temperature: float | None = Form(None, ge=0.0, le=2.0),
    ) -> AskResponse:
        require_ready()
        data = await image.read()

        def build():
            picture = decode(data, "image")
            return engine.prepare(
                [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}]}]
            )

        prompt = await run_prepared(build)
        try:
            limit = engine.resolve_max_tokens(prompt, max_tokens)
        except EngineError as error:
            raise from_engine_error(error) from None
        defaults = engine.sampling_defaults()
        params = SamplingParams(
            max_tokens=limit,
            temperature=temperature if temperature is not None else defaults["temperature"],
            top_p=defaults["top_p"],
        )
        sink = QueueSink(asyncio.get_running_loop())
        sequence = submit(prompt, params, sink)
        text, reason, usage = await collect(request, sequence, sink)
        return AskResponse(
            answer=text, finish_reason=reason, model=settings.server.served_model_name, usage=_usage(usage)
        )

    app.state.started = time.time()
    return app
