"""Release wheels for the deploy tiers: this checkout's, and others that differ from it by one comment."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

from conftest import REPO

INPUTS = ("service", "templates", "roles/vlserve_deploy/defaults", "roles/vlserve_front/defaults", "scripts/release")


def checkout_release(directory: pathlib.Path) -> dict:
    """scripts/release's description of this checkout's wheel, built into `directory`."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "release"), "--out", str(directory)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def build_release(directory: pathlib.Path, marker: str | None = None) -> dict:
    """scripts/release's description of a wheel built from a copy of this checkout, with `marker`
    appended as a comment to one module: another release, as a new commit would make."""
    tree = directory / "src"
    for name in INPUTS:
        source, target = REPO / name, tree / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True, ignore=ignore)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if marker:
        module = tree / "service" / "vlserve" / "errors.py"
        module.write_text(module.read_text() + "# %s\n" % marker)
    result = subprocess.run(
        [sys.executable, str(tree / "scripts" / "release"), "--out", str(directory / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)
