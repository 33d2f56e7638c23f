"""Debian packages for tests on this machine, downloaded and unpacked into the harness cache, never
installed: no service of theirs starts here, nothing under /etc changes."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

from harness.host import CACHE


def unpacked(name: str, packages: tuple[str, ...], marker: str) -> pathlib.Path:
    """The root the packages are unpacked below (CACHE/name), made once; `marker`, a file below it,
    says the unpacking is complete and of these packages."""
    root = CACHE / name
    if (root / marker).exists():
        return root
    downloads = CACHE / (name + "-debs")
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True)
    download = ["apt-get", "download", *packages]
    if subprocess.run(download, cwd=downloads, capture_output=True, check=False).returncode != 0:
        # A fresh machine may have no package lists yet (the setup updates them only to install).
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
        subprocess.run(download, cwd=downloads, check=True, capture_output=True)
    staging = root.with_suffix(".partial")
    shutil.rmtree(staging, ignore_errors=True)
    for deb in sorted(downloads.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)
    return root


def environment(root: pathlib.Path) -> dict[str, str]:
    """This process's environment with the unpacked libraries found first."""
    return dict(os.environ, LD_LIBRARY_PATH=str(root / "usr" / "lib" / "x86_64-linux-gnu"))
