"""Ruff on the whole tree: lint rules and formatting (ruff.toml)."""

from __future__ import annotations

import pytest

from conftest import run_tool


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args):
    result = run_tool("ruff", *args)
    assert result.returncode == 0, result.stdout + result.stderr
