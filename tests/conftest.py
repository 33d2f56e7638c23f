"""Shared paths and helpers for the test suite."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vlserve.bench.servers import LocalServer, free_port  # noqa: F401 - free_port is the tests' too

REPO = pathlib.Path(__file__).resolve().parent.parent
TOPOLOGIES = REPO / "tests" / "fixtures" / "topologies"
SCHEMAS = REPO / "service" / "vlserve" / "schemas"
VENV_BIN = pathlib.Path(sys.executable).parent

sys.path.insert(0, str(REPO / "tests"))

# Workers started by the tests (in-process and as commands) keep their weight cache here, not in the
# home directory of whoever runs the suite; tests that check the cache itself pass their own.
WEIGHT_CACHE = tempfile.mkdtemp(prefix="vlserve-test-weight-cache-")
atexit.register(shutil.rmtree, WEIGHT_CACHE, True)
os.environ["VLSERVE_WEIGHT_CACHE"] = WEIGHT_CACHE
# And build vlserve's int8 decode kernel here, once for the whole run (every worker process loads it).
NATIVE_KERNELS = tempfile.mkdtemp(prefix="vlserve-test-kernels-")
atexit.register(shutil.rmtree, NATIVE_KERNELS, True)
os.environ["VLSERVE_NATIVE_KERNELS"] = NATIVE_KERNELS


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


def vm_flags_at(address: int) -> set[str]:
    """The smaps VmFlags of this process's mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(value, 16) for value in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError("no mapping holds %#x" % address)


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


@pytest.fixture(scope="session")
def torch_wheel(tmp_path_factory) -> str:
    """The CPU torch wheel as pip on this machine finds it: the deploy role installs it on test hosts."""
    target = tmp_path_factory.mktemp("wheels")
    pin = next(
        line for line in (REPO / "service" / "requirements.txt").read_text().splitlines() if line.startswith("torch==")
    )
    # As scripts/bootstrap finds it: a wheel pip's own configuration provides, else the CPU index
    # (never PyPI's, whose torch for Linux is the CUDA build).
    download = [str(VENV_BIN / "pip"), "download", "-q", "--no-deps", "-d", str(target), pin]
    if subprocess.run([*download, "--no-index"], check=False, capture_output=True, timeout=600).returncode:
        index = os.environ.get("VLSERVE_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
        subprocess.run([*download, "--index-url", index], check=True, timeout=1800)
    return str(next(target.glob("torch-*.whl")))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny random-weight Qwen3-VL checkpoint, made by the CLI as a user would make it."""
    directory = tmp_path_factory.mktemp("models") / "tiny"
    result = run_tool("vlserve", "make-test-model", str(directory), "--size", "tiny", timeout=300)
    assert result.returncode == 0, result.stderr
    return directory


class Server(LocalServer):
    """`vlserve serve` in a subprocess on a free loopback port (the benchmarks' own server handle)."""

    def __init__(self, model: pathlib.Path, *flags: str, env: dict | None = None):
        super().__init__(model, args=list(flags), environment=dict(TOOL_ENV, **(env or {})))

    def wait_ready(self, timeout: float = 180) -> Server:
        return super().wait_ready(timeout_s=timeout)

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def metrics(self) -> dict:
        """Samples of /metrics by (name, labels), parsed with prometheus_client's own parser."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples


@pytest.fixture(scope="module")
def server(tiny_model):
    """A worker with default settings on the tiny model, shared by a test module."""
    running = Server(tiny_model).wait_ready()
    yield running
    running.stop()
