"""Shared paths and helpers for the test suite."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A tiny random-weight Qwen3-VL checkpoint, made by the CLI as a user would make it."""
    directory = tmp_path_factory.mktemp("models") / "tiny"
    result = run_tool("vlserve", "make-test-model", str(directory), "--size", "tiny", timeout=300)
    assert result.returncode == 0, result.stderr
    return directory


class Server:
    """`vlserve serve` in a subprocess on a free loopback port; stopped at the end of its fixture."""

    def __init__(self, model: pathlib.Path, *flags: str, env: dict | None = None):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log = tempfile.NamedTemporaryFile(prefix="vlserve-", suffix=".log", delete=False)  # noqa: SIM115
        command = [
            str(VENV_BIN / "vlserve"),
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=dict(TOOL_ENV, **(env or {}))
        )

    def wait_ready(self, timeout: float = 180) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError("vlserve exited with %s:\n%s" % (self.process.returncode, self.output()))
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("vlserve not ready after %.0f s:\n%s" % (timeout, self.output()))

    def output(self) -> str:
        return pathlib.Path(self.log.name).read_text(errors="replace")

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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server(tiny_model):
    """A worker with default settings on the tiny model, shared by a test module."""
    running = Server(tiny_model).wait_ready()
    yield running
    running.stop()
