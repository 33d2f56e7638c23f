"""`vlserve probe` and `vlserve plan` as a user runs them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import TOPOLOGIES, run_tool
from vlserve.ops import units

ALL = sorted(TOPOLOGIES.glob("*.json"))
INFEASIBLE_EXACT = {"wsl2-8cpu-6g"}  # with exact weights; quantize: auto rounds them until a worker fits


def vlserve(*args):
    return run_tool("vlserve", *args, timeout=120)


def test_probe_json_here_follows_the_schema(facts_schema):
    result = vlserve("probe", "--json")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), facts_schema)


def test_probe_table_here():
    result = vlserve("probe")
    assert result.returncode == 0, result.stderr
    for label in ("topology", "isa", "allowed cpus", "memory", "cpufreq", "platform"):
        assert label in result.stdout


def test_plan_here_prints_facts_and_plan():
    result = vlserve("plan")
    assert result.returncode == 0, result.stderr
    assert "workers" in result.stdout and "worker 0" in result.stdout and "dtype" in result.stdout


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
@pytest.mark.parametrize("quantize", ["auto", "none"])
def test_plan_on_every_fixture(path, quantize, plan_schema):
    result = vlserve("plan", "--facts", str(path), "--json", "--quantize", quantize)
    plan = json.loads(result.stdout)
    jsonschema.validate(plan, plan_schema)
    if path.stem in INFEASIBLE_EXACT and quantize == "none":
        assert result.returncode == 1
        assert "cannot plan" in result.stderr and plan["error"] in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert plan["workers"]["count"] == len(plan["worker_list"]) >= 1
    table = vlserve("plan", "--facts", str(path), "--quantize", quantize)
    assert table.returncode == result.returncode


def test_plan_flags_follow_the_policy():
    path = TOPOLOGIES / "xeon-gold-6248r-2s.json"
    plan = json.loads(
        vlserve("plan", "--facts", str(path), "--json", "--policy", "latency", "--base-port", "9000").stdout
    )
    assert plan["workers"]["threads"] == [15, 15]
    assert [w["port"] for w in plan["worker_list"]] == [9000, 9001]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--swappiness", "500"], "swappiness must be empty or an integer from 0 to 200"),
        (["--allowed-cpus", "0-64"], "allowed_cpus has CPUs 2-64 that this host does not allow"),
    ],
)
def test_bad_policy_exits_2_with_the_reason(args, message):
    result = vlserve("plan", "--facts", str(TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json"), *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_unknown_policy_is_refused_by_the_parser():
    result = vlserve("plan", "--policy", "fastest")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_render_units_writes_every_destination_once_from_the_plan(tmp_path):
    facts = TOPOLOGIES / "xeon-gold-6248r-2s.json"
    result = run_tool(
        "vlserve", "render-units", "--out", str(tmp_path), "--facts", str(facts), "--front-bind", "127.0.0.1"
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(run_tool("vlserve", "plan", "--json", "--facts", str(facts)).stdout)
    written = {"/" + str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    expected = set(units.UNIT_FILES.values()) | set(units.CONFIG_FILES.values())
    expected.add(units.PLAN_FILE)
    for worker in plan["worker_list"]:
        expected |= {path.format(index=worker["index"]) for path in units.WORKER_FILES.values()}
    assert written == expected
    worker = plan["worker_list"][-1]
    env = (tmp_path / units.WORKER_FILES["worker.env.j2"].format(index=worker["index"]).lstrip("/")).read_text()
    assert env.startswith("#\n# Managed by vlserve render-units")
    assert "VLSERVE_MEMORY_LIMIT_BYTES=%d\n" % worker["memory_guard_bytes"] in env
    assert "OMP_PLACES=%s\n" % worker["environment"]["OMP_PLACES"] in env
    assert json.loads((tmp_path / units.PLAN_FILE.lstrip("/")).read_text()) == plan  # the status page's plan
    shared = (tmp_path / units.CONFIG_FILES["vlserve.env.j2"].lstrip("/")).read_text()
    assert "VLSERVE_PLAN_FILE=%s\n" % units.PLAN_FILE in shared


def broken_facts(tmp_path, change) -> str:
    facts = json.loads((TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json").read_text())
    text = change(facts)
    path = tmp_path / "facts.json"
    path.write_text(text if isinstance(text, str) else json.dumps(facts))
    return str(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: json.dumps(f)[:500], "is not valid JSON (truncated?)"),
        (lambda f: f.pop("memory"), "facts: memory is missing"),
        (lambda f: f["memory"].update(total_bytes="lots"), "memory.total_bytes must be an integer >= 1, not 'lots'"),
        (lambda f: f["cpu"].update(physical_cores=-16), "cpu.physical_cores must be an integer >= 1, not -16"),
        (lambda f: f["cpu"].update(topology=[]), "cpu.topology must hold at least 1 item(s)"),
        (lambda f: f.update(schema="vlserve.facts/9"), "facts schema 'vlserve.facts/9' is not 'vlserve.facts/1'"),
        (lambda f: "[1, 2]", "facts must be a JSON object, not list"),
    ],
    ids=["truncated", "missing-section", "string-for-number", "negative-count", "empty-topology", "schema", "list"],
)
def test_bad_facts_get_one_line_and_exit_2(tmp_path, change, message):
    path = broken_facts(tmp_path, change)
    for command in ("plan", "render-units"):
        extra = ["--out", str(tmp_path / "out")] if command == "render-units" else []
        result = vlserve(command, "--facts", path, *extra)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_exit_codes_tell_bad_input_from_a_host_too_small(tmp_path):
    assert vlserve("plan", "--facts", str(TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json")).returncode == 0
    assert vlserve("plan", "--facts", str(TOPOLOGIES / "wsl2-8cpu-6g.json"), "--quantize", "none").returncode == 1
    assert vlserve("plan", "--facts", str(tmp_path / "missing.json")).returncode == 2


def test_the_published_facts_schema_is_the_one_the_planner_checks():
    assert run_tool("python", "scripts/schemas", "--check").returncode == 0


def test_render_fleet_writes_the_fleet_front_from_the_same_templates(tmp_path):
    result = vlserve(
        "render-fleet", "--out", str(tmp_path), "--backend", "a=127.0.1.1:8100:2", "--backend", "b=127.0.1.2:8101",
        "--bind", "127.0.0.1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = {"/" + str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == set(units.FLEET_FILES.values())
    config = (tmp_path / units.FLEET_FILES["fleet-haproxy.cfg.j2"].lstrip("/")).read_text()
    assert "balance leastconn" in config and "option httpchk GET /readyz" in config
    assert "server a 127.0.1.1:8100 weight 2 check" in config and "server b 127.0.1.2:8101 weight 1 check" in config
    assert "stats socket %s mode 600 level admin" % units.FLEET_SOCKET in config
    assert "backend %s" % units.FLEET_BACKEND in config
    assert vlserve("render-fleet", "--out", str(tmp_path), "--backend", "a=nowhere").returncode == 2


def test_fleet_backends_come_from_the_inventory_and_the_plans():
    hostvars = {
        "one": {"ansible_host": "10.0.0.1", "vlserve_plan": {"workers": {"count": 3}}},
        "two": {
            "vlserve_deploy_front_bind": "127.0.1.2",
            "vlserve_deploy_front_port": 8200,
            "vlserve_deploy_front_tls": "false",
        },
        "three": {"vlserve_fleet_address": "lb-side.example", "vlserve_plan": {"workers": {"count": 999}}},
    }
    assert units.fleet_backends(["one", "two", "three"], hostvars) == [
        {"name": "one", "address": "10.0.0.1", "port": 8100, "tls": True, "weight": 3},
        {"name": "two", "address": "127.0.1.2", "port": 8200, "tls": False, "weight": 1},
        {"name": "three", "address": "lb-side.example", "port": 8100, "tls": True, "weight": 256},
    ]
