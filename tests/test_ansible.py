"""The playbooks and roles: lint, argument specs against the planner, and the audit on localhost.

Only read-only plays run against this machine (the facts role and the audit, which refuses to
run without --check); the tuning roles are tested on throwaway systemd hosts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import pathlib
import shutil
import typing

import pytest
import yaml

from conftest import REPO, TOPOLOGIES, run_tool
from vlserve import sizing
from vlserve.ops.audit import TUNING_FILES
from vlserve.sizing import contract


def playbook(*args, check=True):
    return run_tool("ansible-playbook", "-i", "localhost,", "-c", "local", *args, *(["--check"] if check else []))


def test_ansible_lint_production_profile():
    result = run_tool("ansible-lint", "--profile", "production", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def role_names():
    return sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks").is_dir())


@pytest.mark.parametrize("role", role_names())
def test_every_role_variable_is_prefixed_specified_and_defaulted_alike(role):
    defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()) or {}
    specs = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options), "defaults/main.yml and argument_specs.yml list different variables"
    for name, option in options.items():
        assert name.startswith(role + "_"), name
        assert option.get("description"), name
        assert option.get("default") == defaults[name], name


def test_facts_role_specs_mirror_the_sizing_policy():
    options = yaml.safe_load((REPO / "roles/vlserve_facts/meta/argument_specs.yml").read_text())["argument_specs"][
        "main"
    ]["options"]
    hints = typing.get_type_hints(sizing.Policy)
    kinds = {int: "int", float: "float", str: "str"}
    for field in dataclasses.fields(sizing.Policy):
        option = options["vlserve_facts_" + field.name]
        base = [a for a in typing.get_args(hints[field.name]) if a is not type(None)] or [hints[field.name]]
        assert option["type"] == kinds.get(base[0], "raw"), field.name
        assert option.get("default") == field.default, field.name
        assert option["description"] == field.metadata["help"], field.name
        # The choices too: the quantize levels and dtypes come from sizing/contract.py through the policy.
        assert tuple(option.get("choices", ())) == field.metadata.get("choices", ()), field.name


def etc_state():
    """Size, mtime and content hash of every regular file under /etc."""
    state = {}
    for path in pathlib.Path("/etc").rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                info = path.stat()
                state[str(path)] = (info.st_size, info.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return state


def test_audit_on_localhost_shows_the_plan_and_changes_nothing(tmp_path):
    before = etc_state()
    result = playbook("playbooks/audit.yml", "-e", "audit_report_dir=%s" % tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "changed=0" in result.stdout and "failed=0" in result.stdout
    plan = json.loads(run_tool("vlserve", "plan", "--json").stdout)
    assert "worker 0" in result.stdout
    assert "%d  (" % plan["workers"]["count"] in result.stdout  # the same planner on both paths
    assert etc_state() == before
    # The fleet's summary: one host here, its plan in one line, its drift, whether it serves.
    fleet = json.loads((tmp_path / "fleet.json").read_text())
    assert fleet["schema"] == "vlserve.fleet-audit/1" and fleet["totals"]["hosts"] == 1
    (host,) = fleet["hosts"]
    report = json.loads((tmp_path / "localhost.json").read_text())
    assert host["host"] == "localhost" and host["drift"] == report["summary"]["drift"]
    assert host["plan"] == "%d x %s threads, %s" % (
        plan["workers"]["count"],
        "/".join(str(t) for t in plan["workers"]["threads"]),
        plan["model"]["dtype"],
    )
    assert "1 host(s): " in result.stdout


def test_a_later_play_of_the_run_keeps_the_plan_only_when_told(tmp_path):
    """A rollout's batches reuse the plan the play before them made (vlserve_facts_reuse_plan); a play
    without it probes again. The captured facts change between the plays, so a probe would show."""
    names = {"small": "cloud-vm-2vcpu.json", "large": "xeon-gold-6248r-2s.json"}
    small, large = (json.loads((TOPOLOGIES / name).read_text()) for name in names.values())
    plays = [
        {
            "name": name,
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [
                {"role": "vlserve_facts", "vars": {"vlserve_facts_captured": facts, "vlserve_facts_reuse_plan": reuse}}
            ],
            "post_tasks": [
                {
                    "name": "Show the workers",
                    "ansible.builtin.debug": {"msg": "%s: {{ vlserve_plan.workers.count }} workers" % name},
                }
            ],
        }
        for name, facts, reuse in (("first", small, False), ("reused", large, True), ("probed", large, False))
    ]
    (tmp_path / "plays.yml").write_text(yaml.safe_dump(plays))
    # playbooks/host_vars/localhost.yml's interpreter, for plays outside playbooks/
    interpreter = "ansible_python_interpreter={{ ansible_playbook_python }}"
    result = playbook(str(tmp_path / "plays.yml"), "-e", "vlserve_facts_quantize=none", "-e", interpreter)
    assert result.returncode == 0, result.stdout + result.stderr
    counts = {}
    for size, name in names.items():
        plan = run_tool("vlserve", "plan", "--facts", str(TOPOLOGIES / name), "--json", "--quantize", "none")
        counts[size] = json.loads(plan.stdout)["workers"]["count"]
    assert counts["small"] != counts["large"], counts
    assert "first: %d workers" % counts["small"] in result.stdout
    assert "reused: %d workers" % counts["small"] in result.stdout
    assert "probed: %d workers" % counts["large"] in result.stdout


def test_an_unpinned_controller_model_is_locked_once_a_run_for_each_directory(tmp_path, tiny_model):
    """Each host's copy of an unpinned controller model is held to the directory's lock as the run
    found it: taken once for the hosts that share the first host's directory, once more by a host
    with a directory of its own (the deploy role's checks, three hosts on localhost, check mode)."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    shutil.copytree(tiny_model, shared)
    shutil.copytree(tiny_model, own)
    (own / "generation_config.json").write_text('{"note": "this host\'s own"}\n')
    hosts = {"first": shared, "second": own, "third": shared}
    inventory = {
        "all": {
            "hosts": {name: {"vlserve_deploy_model_controller_dir": str(path)} for name, path in hosts.items()},
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                "vlserve_deploy_model_source": "controller",
            },
        }
    }
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    shows = "{{ inventory_hostname }} pins {{ __vlserve_deploy_model_pin.files['generation_config.json'].sha256 }}"
    plays = [
        {
            "name": "Checks",
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                {"ansible.builtin.include_role": {"name": "vlserve_deploy", "tasks_from": "checks", "public": True}},
                {"name": "Show the pin", "ansible.builtin.debug": {"msg": shows}},
            ],
        }
    ]
    (tmp_path / "plays.yml").write_text(yaml.safe_dump(plays))
    result = run_tool("ansible-playbook", "-i", str(tmp_path / "inventory.yml"), str(tmp_path / "plays.yml"), "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    for name, path in hosts.items():
        expected = hashlib.sha256((path / "generation_config.json").read_bytes()).hexdigest()
        assert "%s pins %s" % (name, expected) in result.stdout, result.stdout[-3000:]
    # one lock of the shared directory (the first host's, for all), one of the other directory
    sections = {part.split("]", 1)[0]: part for part in result.stdout.split("TASK [vlserve_deploy : ")[1:]}
    assert "ok: [first -> localhost]" in sections["Lock the controller's unpinned model, once a run"]
    own = sections["Lock a host's own unpinned model directory"]
    assert "ok: [second -> localhost]" in own and "skipping: [first]" in own and "skipping: [third]" in own, own


def test_audit_refuses_to_run_without_check():
    result = playbook("playbooks/audit.yml", check=False)
    assert result.returncode != 0
    assert "must run with --check" in result.stdout


def test_audit_reports_an_infeasible_host_instead_of_failing():
    facts = json.loads((TOPOLOGIES / "wsl2-8cpu-6g.json").read_text())
    result = playbook(
        "playbooks/audit.yml", "-e", json.dumps({"vlserve_facts_captured": facts, "vlserve_facts_quantize": "none"})
    )
    assert result.returncode == 0, result.stdout
    assert "no plan: one Qwen3-VL-2B-Instruct worker needs" in result.stdout


def test_a_tag_reapplies_one_concern_after_the_sizing():
    result = playbook("playbooks/tune.yml", "--list-tasks", "--tags", "memory", check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    tasks = [line.strip().split("\t")[0] for line in result.stdout.splitlines() if " : " in line]
    roles = {task.split(" : ")[0] for task in tasks}
    assert {"vlserve_facts", "vlserve_memory"} <= roles
    # Of the other roles only the validation of their variables runs: a bad value still stops the play.
    others = [task for task in tasks if task.split(" : ")[0] not in ("vlserve_facts", "vlserve_memory")]
    assert others and all(" : Validating arguments against arg spec" in task for task in others), others


def test_docs_role_variables_match_the_argument_specs():
    result = run_tool("python", "scripts/role-docs", "--check")
    assert result.returncode == 0, result.stderr


def test_tuning_roles_take_their_paths_from_the_audit():
    """The files the roles write are the ones the audit reads: named once, in audit.TUNING_FILES."""
    for path in (REPO / "roles").glob("*/tasks/*.yml"):
        text = path.read_text()
        for name, target in TUNING_FILES.items():
            assert target not in text, "%s writes %s itself; use vlserve_tuning_files.%s" % (path, target, name)


def test_captured_facts_that_break_the_schema_fail_with_one_line():
    facts = json.loads((TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json").read_text())
    facts["cpu"]["physical_cores"] = -16
    result = playbook("playbooks/audit.yml", "-e", json.dumps({"vlserve_facts_captured": facts}))
    assert result.returncode == 2, result.stdout
    assert "invalid vlserve_facts_captured facts: facts: cpu.physical_cores must be an integer >= 1, not -16" in (
        result.stdout
    )


def test_unknown_deploy_settings_stop_the_audit_before_anything_else():
    result = playbook("playbooks/audit.yml", "-e", json.dumps({"vlserve_deploy_settings": {"max_pixelz": 1}}))
    assert result.returncode == 2, result.stdout
    assert "vlserve_deploy_settings.max_pixelz is not a setting" in result.stdout


def test_the_audit_and_the_play_share_the_certificate_renewal_margin():
    defaults = yaml.safe_load((REPO / "roles/vlserve_credentials/defaults/main.yml").read_text())
    assert defaults["vlserve_credentials_renew_days"] == contract.CERTIFICATE_RENEW_DAYS
