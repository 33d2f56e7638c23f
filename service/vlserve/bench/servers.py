"""Local `vlserve serve` processes for the benchmarks: started with given settings and CPUs, timed
from process start to ready, watched for peak memory, stopped.

`start_plan_workers` starts what the deploy role would run for a plan (each worker's environment
and CPUs from the plan), without systemd, so the benchmarks measure the plan itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from vlserve.bench import pagehistory
from vlserve.bench.loadgen import MemoryWatch
from vlserve.sizing.contract import ENV_PREFIX


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """A server process on a loopback port: timed from process start to ready (`ready_path` answers
    200), its resident memory watched, its output kept until it stops."""

    ready_path = "/readyz"

    def __init__(self, command: list[str], *, port: int, name: str, env=None, preexec_fn=None):
        self.port = port
        self.url = "http://127.0.0.1:%d" % port
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix="vlserve-bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - only sched_setaffinity, which takes no lock
        )
        self.memory = MemoryWatch([self.process.pid], interval_s=0.1).__enter__()
        self.ready_after_s: float | None = None

    def wait_ready(self, timeout_s: float = 900):
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed("%s exited with %s:\n%s" % (self.name, self.process.returncode, self.output(40)))
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.ready_after_s = time.perf_counter() - self.started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise ServerFailed("%s not ready after %.0f s:\n%s" % (self.name, timeout_s, self.output(40)))

    def output(self, lines: int | None = None) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) if lines else text

    @property
    def peak_rss_bytes(self) -> int:
        return self.memory.peak_bytes

    def stop(self) -> None:
        self.memory.__exit__(None, None, None)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalServer(ServerProcess):
    """One `vlserve serve` on a loopback port. `settings`: VLSERVE_* names without the prefix."""

    def __init__(
        self,
        model: Path,
        settings: dict[str, str] | None = None,
        *,
        cpus: list[int] | None = None,
        environment: dict[str, str] | None = None,
        port: int | None = None,
        name: str = "vlserve",
        args: list[str] | None = None,
    ):
        """`args`: extra `vlserve serve` flags (they win over settings, as on the command line)."""
        port = port or free_port()
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        env.update(environment or {})
        env.update({ENV_PREFIX + key.upper(): str(value) for key, value in (settings or {}).items()})
        env.update({"VLSERVE_MODEL": str(model), "VLSERVE_HOST": "127.0.0.1", "VLSERVE_PORT": str(port)})
        super().__init__(
            [sys.executable, "-m", "vlserve.cli", "serve", *(args or [])],
            port=port,
            name=name,
            env=env,
            # Pinned as systemd's CPUAffinity= would pin it; the server's threads inherit the mask.
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.settled_after_s: float | None = None

    def wait_settled(self, timeout_s: float = 900) -> LocalServer:
        """Wait for the work a ready worker still does in the background (prefill copies, checkpoint copies)."""
        deadline = time.perf_counter() + timeout_s
        while self.info().get("background_steps_pending"):
            if time.perf_counter() > deadline:
                raise ServerFailed("%s still busy with its background steps after %.0f s" % (self.name, timeout_s))
            time.sleep(0.1)
        self.settled_after_s = time.perf_counter() - self.started
        return self

    def info(self) -> dict:
        return httpx.get(self.url + "/readyz", timeout=5).json()


def start_plan_workers(model: Path, plan: dict, extra: dict[str, str] | None = None) -> list[LocalServer]:
    """Every worker of a plan, each with the plan's environment and CPUs, ready; stopped on failure."""
    servers: list[LocalServer] = []
    try:
        for worker in plan["worker_list"]:
            environment = {k: v for k, v in worker["environment"].items() if not k.startswith(ENV_PREFIX)}
            settings = {k[len(ENV_PREFIX) :]: v for k, v in worker["environment"].items() if k.startswith(ENV_PREFIX)}
            settings.update(extra or {})
            servers.append(
                LocalServer(
                    model,
                    settings,
                    cpus=worker["cpus"] + worker["sibling_cpus"],
                    environment=environment,
                    name="worker %d" % worker["index"],
                )
            )
        for server in servers:
            server.wait_ready()
        for server in servers:  # benchmarks measure the steady state, not the first seconds
            server.wait_settled()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def warm_page_cache(model: Path) -> None:
    """Read the checkpoint once, so startups are timed from a warm page cache as the targets say."""
    warm_files(path for path in sorted(model.iterdir()) if path.is_file())


def warm_files(paths: Iterable[Path]) -> None:
    """Read each file once into the page cache."""
    for path in paths:
        pagehistory.read_in_order(path)


def mapped_files(pid: int) -> set[Path]:
    """The regular files a running process maps (/proc/PID/maps): for a worker, the checkpoint's
    shards, its level's weight cache and the libraries it imported, all it reads again at a start."""
    files = set()
    with open("/proc/%d/maps" % pid) as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith("(deleted)\n"):
                files.add(Path(fields[5].rstrip("\n")))
    return {path for path in files if path.is_file()}
