"""What every part of the sizing engine shares: schema names, units and the planner's one error."""

from __future__ import annotations

FACTS_SCHEMA = "vlserve.facts/1"
PLAN_SCHEMA = "vlserve.plan/1"
GIB = 1024**3
MIB = 1024**2


class PlanError(Exception):
    """The host cannot run even one worker under this policy; the message says why and what to do."""


def gib(value: float) -> str:
    """Bytes as people read them in a plan: "6.7 GiB"."""
    return "%.1f GiB" % (value / GIB)
