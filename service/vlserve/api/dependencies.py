"""What a route may ask for (FastAPI dependencies): the settings, the engine, a ready engine, the
submission path, and the API key check. Handles live on `app.state`, set once by `create_app`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from vlserve.api.errors import APIError, not_ready
from vlserve.api.submission import Submitter
from vlserve.runtime.engine import Engine
from vlserve.runtime.metrics import Metrics
from vlserve.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_submitter(request: Request) -> Submitter:
    if not request.app.state.engine.ready:
        raise not_ready(request.app.state.engine.state)
    return request.app.state.submitter


def authorize(request: Request, settings: Annotated[Settings, Depends(get_settings)]) -> None:
    """With an API key configured, /v1/ requests must carry `Authorization: Bearer <key>`."""
    key = settings.server.api_key
    if key is None:
        return
    if request.headers.get("authorization", "") != "Bearer " + key.get_secret_value():
        raise APIError(
            401,
            "missing or wrong API key (Authorization: Bearer <key>)",
            "authentication_error",
            code="invalid_api_key",
        )


SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[Engine, Depends(get_engine)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
ReadySubmitter = Annotated[Submitter, Depends(get_submitter)]
