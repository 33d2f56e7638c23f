"""Health for process managers and load balancers, and Prometheus metrics.

/healthz: the process answers (always 200). /readyz: 200 only once the model is loaded and warmed
up, with what it runs; 503 before. /metrics: the Prometheus text format.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from vlserve.api.dependencies import EngineDep, MetricsDep
from vlserve.api.errors import error_response, not_ready

router = APIRouter(include_in_schema=False)


@router.get("/healthz")
async def healthz(engine: EngineDep) -> dict:
    return {"status": "alive", "model_state": engine.state}


@router.get("/readyz")
async def readyz(engine: EngineDep):
    if not engine.ready:
        return error_response(not_ready(engine.state))
    return {
        "status": "ready",
        "queue_depth": engine.queue_depth,
        "running": engine.running,
        "prefill_copies_pending": engine.prefill_copies_pending,
        "background_steps_pending": engine.background_steps_pending,
        **engine.running_as(),
    }


@router.get("/metrics")
async def metrics(registry: MetricsDep) -> Response:
    return PlainTextResponse(registry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
