"""Golden plans: every fixture topology under three policies, plan and text, exactly as recorded.

A change to the planner that moves any of these is either a bug or a decision: regenerate with
`VLSERVE_REGENERATE_GOLDEN=1 scripts/test tests/test_sizing_golden.py` and let the diff of
tests/fixtures/plans/ show, in review, what moved and why.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, TOPOLOGIES, load_topology
from vlserve import sizing

GOLDEN = REPO / "tests" / "fixtures" / "plans"
POLICIES = {
    "default": {},
    "latency": {"objective": "latency"},
    "int8": {"quantize": "int8", "max_batch_size": 8},
}
ALL = sorted(p.stem for p in TOPOLOGIES.glob("*.json"))


def planned(name: str) -> dict:
    facts = load_topology(name)
    out = {}
    for label, values in POLICIES.items():
        try:
            result = sizing.plan(facts, sizing.Policy.from_mapping(values))
            out[label] = {"plan": result, "text": sizing.render_plan(result).splitlines()}
        except sizing.PlanError as error:
            out[label] = {"error": str(error)}
    out["facts_text"] = sizing.render_facts(facts).splitlines()
    return out


@pytest.mark.parametrize("name", ALL)
def test_plan_is_the_recorded_one(name):
    path = GOLDEN / (name + ".json")
    current = planned(name)
    if os.environ.get("VLSERVE_REGENERATE_GOLDEN") == "1":
        path.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(path.read_text())
    for label in recorded:
        assert current[label] == recorded[label], "%s / %s moved" % (name, label)
    assert set(current) == set(recorded)
