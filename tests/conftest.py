"""Shared paths and helpers for the test suite."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TOPOLOGIES = REPO / "tests" / "fixtures" / "topologies"
SCHEMAS = REPO / "service" / "vlserve" / "schemas"
VENV_BIN = pathlib.Path(sys.executable).parent

sys.path.insert(0, str(REPO / "tests"))


def load_topology(name: str) -> dict:
    return json.loads((TOPOLOGIES / (name + ".json")).read_text())


@pytest.fixture(scope="session")
def facts_schema() -> dict:
    return json.loads((SCHEMAS / "facts.schema.json").read_text())


@pytest.fixture(scope="session")
def plan_schema() -> dict:
    return json.loads((SCHEMAS / "plan.schema.json").read_text())
