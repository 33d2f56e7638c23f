"""What `vlserve kernels` found on this host (`<cache>/build.json`), and what that finding depends on.

Read without torch: a deploy that changes nothing finds the record of the same inputs and a library
still in place, and answers in half a second where loading torch and checking every op again took
about 4 (each host, each run). The inputs are everything the outcome depends on: the kernels'
sources and the Python that checks and loads them (this package's files), torch's version, the
Python ABI, the CPU (its flags and vendor: a VM can migrate to another CPU between two runs) and
the two variables that hold torch and oneDNN below it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sysconfig
import tempfile
from pathlib import Path

BUILD_RECORD = "build.json"  # beside the builds: the deploy role reads it, workers name it when there is no build
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # each holds a tier or AMX back
_PACKAGE = Path(__file__).parent
_PACKAGE_FILES = ("*.py", "*.cpp", "*.h")


def cpuinfo_field(name: str) -> str | None:
    """The first CPU's `name` line in /proc/cpuinfo, None when unreadable."""
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.split(":", 1)[0].strip() == name
        )
    except (OSError, StopIteration):
        return None


def inputs() -> str:
    """A digest of everything `vlserve kernels`' outcome depends on (the module's docstring)."""
    digest = hashlib.sha256()
    files = sorted(path for pattern in _PACKAGE_FILES for path in _PACKAGE.glob(pattern))
    parts = [path.name.encode() + b"\0" + path.read_bytes() for path in files]
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    facts = (
        torch_version,
        sysconfig.get_config_var("SOABI") or "",
        platform.machine(),
        cpuinfo_field("vendor_id") or "",
        cpuinfo_field("flags") or "",
        *("%s=%s" % (name, os.environ.get(name, "")) for name in ISA_VARIABLES),
    )
    for part in (*parts, *(fact.encode() for fact in facts)):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:32]


def read(root: Path) -> dict | None:
    """The record under `root`, None when there is none or it does not parse as one."""
    try:
        record = json.loads((root / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def still_holds(root: Path, digest: str) -> dict | None:
    """The record under `root` when it found vlserve's kernels for these very inputs and their library is
    still in place, else None (a failure is always looked at again: a compiler may have come since)."""
    record = read(root)
    if record is None or record.get("inputs") != digest or record.get("own") is not True:
        return None
    library = record.get("library")
    return record if isinstance(library, str) and Path(library).is_file() else None


def write(root: Path, record: dict) -> None:
    """Written aside and renamed: a worker reading it meanwhile sees the old record or the new."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.NamedTemporaryFile("w", dir=root, prefix=".build-", delete=False) as handle:
        json.dump(record, handle, indent=1)
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, root / BUILD_RECORD)
