"""Shared paths and helpers for the test suite."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
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


TOOL_ENV = dict(
    os.environ, PATH="%s:%s" % (VENV_BIN, os.environ.get("PATH", "")), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0"
)


def run_tool(tool: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run one of the venv's tools from the repository root and capture what it prints."""
    return subprocess.run(
        [str(VENV_BIN / tool), *args],
        cwd=REPO,
        env=TOOL_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
