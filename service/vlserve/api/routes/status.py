"""`/status`: what the status page shows of this worker, as JSON: who it is, its state, its plan as
the sizing engine gave it (with the reasons), and live figures from its own metrics.

Open without the API key, as /metrics and /readyz are: nothing here is beyond what those show, save
the plan's reasons.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from fastapi import APIRouter, Request

from vlserve.api.dependencies import EngineDep, MetricsDep, SettingsDep
from vlserve.sizing import format_cpu_list

router = APIRouter(include_in_schema=False)
log = logging.getLogger(__name__)

MODEL_CHOICES = ("dtype", "vision_dtype", "prefill_dtype", "quantize", "packed_weights")
# The reason the plan gives for each choice (plan.schema.json's model section).
REASONS = {
    "dtype": "why",
    "vision_dtype": "vision_why",
    "prefill_dtype": "prefill_why",
    "quantize": "quantize_why",
    "packed_weights": "packed_why",
}


def worker_name(port: int) -> str:
    """How this worker names itself in `/status` and the X-Vlserve-Worker header: host and port."""
    return "%s:%d" % (socket.gethostname(), port)


def _host_plan(settings, engine) -> tuple[dict[str, Any] | None, str]:
    path = settings.server.plan_file
    if path is not None:
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, ValueError) as error:
            log.warning("status: cannot read the plan file %s (%s): showing this process's own plan", path, error)
    return (engine.loaded_as.plan if engine.loaded_as else None), "this process (vlserve serve on auto)"


def plan_view(plan: dict[str, Any], source: str, port: int) -> dict[str, Any]:
    """The parts of a plan a person reads on the status page: this worker's share and the reasons."""
    workers = plan["worker_list"]
    mine = next((worker for worker in workers if worker["port"] == port), workers[0])
    model = plan["model"]
    return {
        "source": source,
        "workers": plan["workers"]["count"],
        "workers_why": plan["workers"]["why"],
        "worker_index": mine["index"],
        "threads": mine["threads"],
        "cpus": format_cpu_list(mine["cpus"]),
        "cores_why": plan["cores"]["why"],
        "memory_why": plan["memory"]["why"],
        "choices": [
            {"name": name, "value": model[name], "why": model.get(REASONS[name], "")} for name in MODEL_CHOICES
        ],
        "batch": {"max_batch_size": model["max_batch_size"], "max_context_tokens": model["max_context_tokens"]},
        "batch_why": model["batch_why"],
    }


@router.get("/status")
async def status(request: Request, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep) -> dict:
    plan, source = _host_plan(settings, engine)
    port = settings.server.port
    try:
        shown = plan_view(plan, source, port) if plan else None
    except (KeyError, IndexError, TypeError) as error:  # a plan file of another shape
        log.warning("status: the plan from %s lacks %s", source, error)
        plan = engine.loaded_as.plan if engine.loaded_as else None
        shown = plan_view(plan, "this process", port) if plan else None
    return {
        "worker": {
            "name": worker_name(port),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - request.app.state.started, 1),
            "model": settings.server.served_model_name,
        },
        "state": engine.state,
        "background_steps_pending": engine.background_steps_pending if engine.ready else None,
        "running_as": engine.running_as(),
        "plan": shown,
        "figures": metrics.snapshot(),
    }
