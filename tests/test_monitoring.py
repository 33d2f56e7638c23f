"""Monitoring, on real parts: the alert rules the role installs pass promtool's check and their unit
tests (every alert fires and stays quiet where it should); its Prometheus and Alertmanager
configurations pass their own tools' checks; and a real Prometheus (Debian's package) scrapes a real
worker through its host front's metrics port and a fleet front's HAProxy, over mutual TLS with the
monitoring host's certificate, as the role configures it: every dashboard query returns data, every
metric a panel names is one the service or HAProxy exports, and killing the worker fires
VlserveWorkerDown when its `for` says."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time

import httpx
import pytest
import yaml

from conftest import REPO, TOOL_ENV, free_port, run_tool
from harness.haproxy import Front, fleet_certificates
from harness.prometheus import ROLE, Prometheus, render, tool
from sample_images import image_question, png_bytes
from vlserve.bench.servers import LocalServer
from vlserve.ops import monitoring, units
from vlserve.sizing import contract

FACTS = REPO / "tests" / "fixtures" / "topologies" / "xeon-avx512bf16-2vcpu-vm.json"
DASHBOARD = ROLE / "files" / "vlserve-dashboard.json"
OPERATING = REPO / "docs" / "operating.md"
KEY = "vls-monitoring-test-" + "m" * 30


def alert_names(rules: dict) -> list[str]:
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The role's rule file with its default thresholds, as Ansible renders it."""
    directory = tmp_path_factory.mktemp("rules")
    render(directory, {"vlserve-alerts.yml.j2": "alerts.yml"})
    return directory


def test_the_alert_rules_pass_promtool_and_every_alert_has_unit_tests_and_a_runbook(rendered):
    checked = subprocess_run([str(tool("promtool")), "check", "rules", str(rendered / "alerts.yml")])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (rendered / "alerts.test.yml").write_text((REPO / "tests" / "monitoring" / "alerts.test.yml").read_text())
    tested = subprocess_run([str(tool("promtool")), "test", "rules", str(rendered / "alerts.test.yml")])
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = alert_names(yaml.safe_load((rendered / "alerts.yml").read_text()))
    assert len(names) == len(set(names)) == 11
    cases = [case for test in yaml.safe_load((rendered / "alerts.test.yml").read_text())["tests"]
             for case in test["alert_rule_test"]]  # fmt: skip
    runbook = OPERATING.read_text()
    for name in names:
        assert any(c["alertname"] == name and c["exp_alerts"] for c in cases), "%s never fires in a test" % name
        assert any(c["alertname"] == name and not c["exp_alerts"] for c in cases), "%s is never quiet in a test" % name
        assert re.search(r"^### %s$" % name, runbook, re.M), "docs/operating.md has no runbook for %s" % name


def test_the_thresholds_are_the_roles_variables(tmp_path):
    """A changed threshold changes the rule: the SLO of the first token at 20 s instead of 10."""
    render(tmp_path, {"vlserve-alerts.yml.j2": "alerts.yml"}, vlserve_monitoring_ttft_p95_slo_s=20)
    rules = {
        r.get("alert"): r for g in yaml.safe_load((tmp_path / "alerts.yml").read_text())["groups"] for r in g["rules"]
    }
    assert rules["VlserveSlowFirstToken"]["expr"].rstrip().endswith("> 20")


def test_the_prometheus_and_alertmanager_configurations_pass_their_tools(tmp_path):
    render(tmp_path, {"prometheus.yml.j2": "prometheus.yml", "alertmanager.yml.j2": "alertmanager.yml"},
           vlserve_monitoring_webhook_url="https://pager.example/hook")  # fmt: skip
    config = subprocess_run(
        [str(tool("promtool")), "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")]
    )
    assert config.returncode == 0, config.stdout + config.stderr
    manager = subprocess_run([str(tool("amtool")), "check-config", str(tmp_path / "alertmanager.yml")])
    assert manager.returncode == 0, manager.stdout + manager.stderr
    jobs = {job["job_name"] for job in yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == {"prometheus", "vlserve_worker", "vlserve_front", "vlserve_fleet_front"}


def test_the_roles_client_name_is_the_one_the_fronts_answer():
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert variables["__vlserve_monitoring_client_cn"] == contract.MONITORING_CLIENT_CN


def subprocess_run(command: list[str]):
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    """A worker behind a host front and a fleet front, both with their metrics port (mutual TLS, the
    private CA), the monitoring host's client certificate, and a Prometheus configured by the role."""
    work = tmp_path_factory.mktemp("monitored")
    ca, pems = fleet_certificates(
        work, monitoring=contract.MONITORING_CLIENT_CN + " m1", stranger=contract.FLEET_CLIENT_CN + " f9"
    )
    (work / "keys.yml").write_text(yaml.safe_dump({"vlserve_clients": [{"name": "alice", "key": KEY}]}))
    worker_port, host_port, host_metrics, fleet_port, fleet_metrics = (free_port() for _ in range(5))
    host_tree, fleet_tree = work / "host", work / "front"
    rendered = run_tool(
        "vlserve", "render-units", "--out", str(host_tree), "--facts", str(FACTS), "--max-workers", "1",
        "--base-port", str(worker_port), "--front-port", str(host_port), "--front-bind", "127.0.0.1",
        "--clients", str(work / "keys.yml"), "--tls-pem", str(pems["host"]), "--fleet-ca", str(ca),
        "--metrics-port", str(host_metrics), "--monitoring-ca", str(ca),
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    fleet_rendered = run_tool(
        "vlserve", "render-fleet", "--out", str(fleet_tree), "--backend", "h1=127.0.0.1:%d" % host_port,
        "--port", str(fleet_port), "--bind", "127.0.0.1", "--clients", str(work / "keys.yml"),
        "--tls-pem", str(pems["fleet"]), "--backend-ca", str(ca), "--client-pem", str(pems["client"]),
        "--check-interval-s", "1", "--metrics-port", str(fleet_metrics), "--monitoring-ca", str(ca),
    )  # fmt: skip
    assert fleet_rendered.returncode == 0, fleet_rendered.stderr
    worker = LocalServer(tiny_model, port=worker_port, environment=TOOL_ENV).wait_ready(timeout_s=180)
    trust = ssl.create_default_context(cafile=str(ca))
    as_fleet = ssl.create_default_context(cafile=str(ca))
    as_fleet.load_cert_chain(str(pems["client"]))
    host = Front(host_tree, units.CONFIG_FILES["haproxy.cfg.j2"]).start(
        "https://127.0.0.1:%d/readyz" % host_port, as_fleet
    )
    front = Front(fleet_tree, units.FLEET_FILES["fleet-haproxy.cfg.j2"]).start(
        "https://127.0.0.1:%d/readyz" % fleet_port, trust
    )
    # Prometheus as the role writes it: its configuration and rules from the role's templates (paths
    # pointed into this directory, one-second scrapes, a worker down after 5 s), its targets from
    # the inventory's function, for an inventory of one service host and one fleet front.
    plan = json.loads((host_tree / units.PLAN_FILE.lstrip("/")).read_text())
    hostvars = {
        "h1": {"ansible_host": "127.0.0.1", "vlserve_deploy_metrics_port": host_metrics, "vlserve_plan": plan},
        "f1": {"ansible_host": "127.0.0.1", "vlserve_front_metrics_port": fleet_metrics},
    }
    targets = monitoring.scrape_targets(["h1"], ["f1"], hostvars)
    (work / "targets").mkdir()
    for job, groups in targets.items():
        (work / "targets" / (job + ".json")).write_text(json.dumps(groups))
    (work / "ca.crt").write_text(ca.read_text())
    prometheus = Prometheus(work / "prometheus.yml", work)
    render(
        work, {"prometheus.yml.j2": "prometheus.yml", "vlserve-alerts.yml.j2": "alerts.yml"},
        vlserve_monitoring_scrape_interval_s=1, vlserve_monitoring_down_for_s=5,
        vlserve_monitoring_prometheus_listen="127.0.0.1:%d" % prometheus.port,
        __vlserve_monitoring_targets_dir=str(work / "targets"), __vlserve_monitoring_rules=str(work / "alerts.yml"),
        __vlserve_monitoring_ca=str(work / "ca.crt"), __vlserve_monitoring_client_pem=str(pems["monitoring"]),
    )  # fmt: skip
    prometheus.start()
    yield {
        "prometheus": prometheus, "worker": worker, "trust": trust, "ca": ca, "pems": pems,
        "fleet": "https://127.0.0.1:%d" % fleet_port, "metrics": "https://127.0.0.1:%d" % host_metrics,
    }  # fmt: skip
    prometheus.stop()
    front.stop()
    host.stop()
    worker.stop()


def wait_for(what: str, check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError("timed out waiting for " + what)


def test_the_metrics_port_answers_the_monitoring_certificate_alone(fleet):
    monitoring_client = ssl.create_default_context(cafile=str(fleet["ca"]))
    monitoring_client.load_cert_chain(str(fleet["pems"]["monitoring"]))
    answered = httpx.get(fleet["metrics"] + "/metrics/worker/0", verify=monitoring_client, timeout=10)
    assert answered.status_code == 200 and "vlserve_ready 1.0" in answered.text
    front = httpx.get(fleet["metrics"] + "/metrics/front", verify=monitoring_client, timeout=10)
    assert (
        front.status_code == 200
        and 'haproxy_server_status{proxy="workers",server="worker0",state="UP"} 1' in front.text
    )
    assert httpx.get(fleet["metrics"] + "/metrics/worker/7", verify=monitoring_client, timeout=10).status_code == 404
    # Another certificate of the same CA (a fleet front's name) is refused; none at all fails the handshake.
    stranger = ssl.create_default_context(cafile=str(fleet["ca"]))
    stranger.load_cert_chain(str(fleet["pems"]["stranger"]))
    refused = httpx.get(fleet["metrics"] + "/metrics/worker/0", verify=stranger, timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "monitoring_only"
    with pytest.raises(httpx.TransportError):
        httpx.get(fleet["metrics"] + "/metrics/front", verify=fleet["trust"], timeout=10)


def exported_names(fleet) -> set[str]:
    """Every metric name a worker and the two HAProxys export, as Prometheus stored them."""
    stored = fleet["prometheus"].query('count by (__name__) ({__name__=~".+"})')
    return {sample["metric"]["__name__"] for sample in stored}


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping labels and strings removed)."""
    bare = re.sub(r"\{[^}]*\}", "", re.sub(r'"[^"]*"', "", expression))
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    return {
        token for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if re.match(r"(vlserve|haproxy)_|up$", token)
    }


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_dashboard_query_returns_data_and_names_only_exported_metrics(fleet):
    prometheus = fleet["prometheus"]
    key = {"Authorization": "Bearer " + KEY}
    body = image_question(png_bytes(), "What colour is it?", max_tokens=4)

    def ask() -> None:
        answered = httpx.post(
            fleet["fleet"] + "/v1/chat/completions", json=body, headers=key, verify=fleet["trust"], timeout=60
        )
        assert answered.status_code == 200, answered.text

    def increased() -> bool:
        found = prometheus.query("sum(increase(vlserve_requests_total[30s]))")
        return bool(found) and float(found[0]["value"][1]) > 0

    # Through the fleet front (the worker's histograms and usage, the fronts' counters): one request
    # before the first scrapes (a counter's first sample is its start, not an increase), more after.
    ask()
    wait_for("the targets to be up", lambda: len(prometheus.targets()) == 4
             and all(t["health"] == "up" for t in prometheus.targets()))  # fmt: skip
    jobs = {target["labels"]["job"] for target in prometheus.targets()}
    assert jobs == {"prometheus", "vlserve_worker", "vlserve_front", "vlserve_fleet_front"}
    for _ in range(3):
        ask()
    wait_for("a scrape after the requests", increased)
    exported = exported_names(fleet)
    queries = dashboard_queries()
    assert len(queries) >= 20
    for title, expression in queries:
        names = metric_names(expression)
        assert names and names <= exported, (title, names - exported)
        assert prometheus.query(expression.replace("$host", ".*")), "no data for %r: %s" % (title, expression)


def test_a_killed_worker_fires_worker_down_when_its_for_says(fleet):
    prometheus = fleet["prometheus"]
    assert not [a for a in prometheus.alerts() if a["labels"]["alertname"] == "VlserveWorkerDown"]
    fleet["worker"].process.kill()
    killed = time.monotonic()
    alert = wait_for(
        "VlserveWorkerDown to fire",
        lambda: [
            a for a in prometheus.alerts() if a["labels"]["alertname"] == "VlserveWorkerDown" and a["state"] == "firing"
        ],
        timeout=60,
    )[0]
    took = time.monotonic() - killed
    assert alert["labels"]["host"] == "h1" and alert["labels"]["worker"] == "0"
    # `for` 5 s, after the first failed scrape (1 s apart), at an evaluation (1 s apart): 5 to ~8 s.
    print("VlserveWorkerDown fired %.1f s after the kill (for: 5 s, scrape and evaluation every 1 s)" % took)
    assert 5 <= took <= 12, took
