"""The service for one worker: the app factory and its lifespan.

The engine loads in the background: /healthz answers at once, /readyz only after the model is
loaded and warmed up. The routes live in `vlserve.api`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import FastAPI

import vlserve
from vlserve.api import notify
from vlserve.api.errors import install_error_handlers
from vlserve.api.middleware import BodyLimitMiddleware, request_counter
from vlserve.api.requestlog import Journal, RequestLogMiddleware
from vlserve.api.routes import ask, health, openai, page, status
from vlserve.api.submission import Submitter
from vlserve.errors import ModelDirectoryError
from vlserve.runtime.engine import Engine
from vlserve.runtime.metrics import Metrics
from vlserve.settings import Settings

log = logging.getLogger("vlserve")


def create_app(
    settings: Settings, engine: Engine | None = None, on_fatal: Callable[[str], None] | None = None
) -> FastAPI:
    """The app for one worker; `on_fatal` hears the reason when the model cannot be loaded."""
    metrics = engine.metrics if engine is not None else Metrics()
    engine = engine or Engine(settings.model, settings.limits, metrics)

    def start_engine() -> None:
        try:
            engine.start(status=notify.status, warmup=settings.model.warmup)
        except Exception as error:
            message = str(error) if isinstance(error, ModelDirectoryError) else "model load failed: %s" % error
            log.error("%s", message, exc_info=not isinstance(error, ModelDirectoryError))
            notify.status(message)
            app.state.fatal = message
            if on_fatal is not None:
                on_fatal(message)
            return
        running = engine.loaded_as
        notify.ready(
            "ready: %s, %s%s, %d threads"
            % (settings.server.served_model_name, running.dtype, " packed" if running.packed else "", running.threads)
        )
        log.info("ready on %s:%d", settings.server.host, settings.server.port)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=start_engine, name="vlserve-loader", daemon=True).start()
        try:
            yield
        finally:
            notify.send("STOPPING=1")
            await anyio.to_thread.run_sync(engine.shutdown)

    app = FastAPI(title="vlserve", version=vlserve.__version__, lifespan=lifespan)
    app.state.engine, app.state.settings, app.state.metrics, app.state.fatal = engine, settings, metrics, None
    app.state.submitter = Submitter(engine, settings)
    app.state.started = time.time()
    app.add_middleware(BodyLimitMiddleware, limit=settings.limits.max_upload_bytes)
    app.middleware("http")(request_counter(metrics))
    worker = status.worker_name(settings.server.port)

    @app.middleware("http")
    async def name_the_worker(request, call_next):
        """Through the front, which worker answered: every response says."""
        response = await call_next(request)
        response.headers["X-Vlserve-Worker"] = worker
        return response

    # Outermost, so every response (errors of the middleware above included) carries the request's ID.
    app.add_middleware(RequestLogMiddleware, journal=Journal())
    install_error_handlers(app)
    for module in (health, openai, ask, status, page):
        app.include_router(module.router)
    return app
