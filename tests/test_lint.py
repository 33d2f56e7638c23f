"""Ruff on the whole tree: lint rules and formatting (ruff.toml)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import REPO, VENV_BIN


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args):
    result = subprocess.run([str(VENV_BIN / "ruff"), *args], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
