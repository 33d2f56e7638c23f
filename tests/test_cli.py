"""`vlserve probe` and `vlserve plan` as a user runs them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import TOPOLOGIES, run_tool
from vlserve import units

ALL = sorted(TOPOLOGIES.glob("*.json"))
INFEASIBLE = {"wsl2-8cpu-6g"}


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
def test_plan_on_every_fixture(path, plan_schema):
    result = vlserve("plan", "--facts", str(path), "--json")
    plan = json.loads(result.stdout)
    jsonschema.validate(plan, plan_schema)
    if path.stem in INFEASIBLE:
        assert result.returncode == 1
        assert "cannot plan" in result.stderr and plan["error"] in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert plan["workers"]["count"] == len(plan["worker_list"]) >= 1
    table = vlserve("plan", "--facts", str(path))
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
    result = vlserve("plan", "--facts", str(TOPOLOGIES / "this-machine.json"), *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_unknown_policy_is_refused_by_the_parser():
    result = vlserve("plan", "--policy", "fastest")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_render_units_writes_every_destination_once_from_the_plan(tmp_path):
    facts = TOPOLOGIES / "xeon-gold-6248r-2s.json"
    result = run_tool("vlserve", "render-units", "--out", str(tmp_path), "--facts", str(facts))
    assert result.returncode == 0, result.stderr
    plan = json.loads(run_tool("vlserve", "plan", "--json", "--facts", str(facts)).stdout)
    written = {"/" + str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    expected = set(units.UNIT_FILES.values()) | set(units.CONFIG_FILES.values())
    expected |= {units.ERROR_PAGE_FILE.format(status=status) for status in units.ERROR_PAGES}
    for worker in plan["worker_list"]:
        expected |= {path.format(index=worker["index"]) for path in units.WORKER_FILES.values()}
    assert written == expected
    worker = plan["worker_list"][-1]
    env = (tmp_path / units.WORKER_FILES["worker.env.j2"].format(index=worker["index"]).lstrip("/")).read_text()
    assert env.startswith("#\n# Managed by vlserve render-units")
    assert "VLSERVE_MEMORY_LIMIT_BYTES=%d\n" % worker["memory_guard_bytes"] in env
    assert "OMP_PLACES=%s\n" % worker["environment"]["OMP_PLACES"] in env
