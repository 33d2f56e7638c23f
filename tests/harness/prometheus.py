"""Prometheus, promtool and Alertmanager's amtool as the monitoring role installs them: Debian's own
packages, unpacked into the harness cache (never installed), run as plain processes on loopback;
and the role's templates rendered by Ansible itself into a test's directory."""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

import httpx

from conftest import REPO, free_port, run_tool
from harness.debs import unpacked

PACKAGES = ("prometheus", "prometheus-alertmanager")
ROLE = REPO / "roles" / "vlserve_monitoring"

RENDER = """
- hosts: localhost
  gather_facts: false
  vars_files: [{defaults}, {vars}]
  tasks:
    - name: Render the role's templates
      ansible.builtin.template:
        src: "{{{{ item.src }}}}"
        dest: "{{{{ item.dest }}}}"
        mode: "0644"
      loop: {files}
"""


def tool(name: str) -> pathlib.Path:
    """/usr/bin/NAME of the packages: prometheus, promtool, amtool, prometheus-alertmanager."""
    return unpacked("prometheus", PACKAGES, "usr/bin/amtool") / "usr" / "bin" / name


def render(directory: pathlib.Path, templates: dict[str, str], **variables) -> None:
    """The role's templates ({template: file name}) rendered by Ansible with the role's defaults and
    vars, `variables` over them, into `directory`."""
    files = [{"src": str(ROLE / "templates" / src), "dest": str(directory / dest)} for src, dest in templates.items()]
    playbook = directory / "render.yml"
    playbook.write_text(
        RENDER.format(defaults=ROLE / "defaults" / "main.yml", vars=ROLE / "vars" / "main.yml", files=json.dumps(files))
    )
    extra = directory / "render-vars.json"
    extra.write_text(json.dumps(variables))
    result = run_tool(
        "ansible-playbook", "-i", "localhost,", "-c", "local", str(playbook), "-e", "@%s" % extra,
        "-e", "ansible_python_interpreter=%s" % (REPO / ".venv" / "bin" / "python"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


class Prometheus:
    """One Prometheus on a loopback port with a rendered configuration."""

    def __init__(self, config: pathlib.Path, workdir: pathlib.Path):
        self.config, self.workdir = config, workdir
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log = workdir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        self.process = subprocess.Popen(
            [str(tool("prometheus")), "--config.file=%s" % self.config,
             "--storage.tsdb.path=%s" % (self.workdir / "data"), "--web.listen-address=127.0.0.1:%d" % self.port],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError("Prometheus did not get ready: " + self.log.read_text()[-3000:])

    def query(self, expression: str) -> list[dict]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expression}, timeout=10).json()
        assert response["status"] == "success", (expression, response)
        return response["data"]["result"]

    def targets(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def alerts(self) -> list[dict]:
        return httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
