#!/usr/bin/python
"""Ansible module: the vlserve sizing engine (probe + plan) run on the target host."""

DOCUMENTATION = r"""
---
module: vlserve_sizing
short_description: Probe a host's CPUs, memory and platform and size the vlserve service for it
description:
  - Runs the sizing engine of the vlserve toolkit on the target (standard library only, psutil and
    py-cpuinfo when present) and returns the facts and the plan as Ansible facts.
  - Read-only; safe and complete in check mode.
options:
  policy:
    description: Sizing policy fields (see C(vlserve plan --help)); null means the planner's default.
    type: dict
    default: {}
  facts:
    description: Facts to plan for instead of probing the target (captured topologies, what-if runs).
    type: dict
  name_prefix:
    description: Prefix of the caller's variable names, so a bad value is reported under its own name.
    type: str
    default: ""
  audit:
    description: Also compare the host's tuning with the plan (vlserve_audit, vlserve_audit_text).
    type: bool
    default: false
author: vlserve toolkit
"""

RETURN = r"""
ansible_facts:
  description: >-
    vlserve_facts, vlserve_plan (null when infeasible), vlserve_plan_error, vlserve_plan_text,
    vlserve_tuning, vlserve_runtime_drift (the knobs whose running state differs from the plan).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.vlserve_audit import TUNING_FILES, audit, probe_tuning, render, runtime_drift, summary
from ansible.module_utils.vlserve_sizing import (
    FactsError,
    PlanError,
    Policy,
    check_facts,
    check_policy_fits,
    plan,
    probe,
    render_facts,
    render_plan,
)


def main():
    module = AnsibleModule(
        argument_spec={
            "policy": {"type": "dict", "default": {}},
            "facts": {"type": "dict"},
            "name_prefix": {"type": "str", "default": ""},
            "audit": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    facts = module.params["facts"] or probe()
    if module.params["facts"]:
        try:
            check_facts(facts)
        except FactsError as error:
            module.fail_json(msg="invalid %sfacts: %s" % (module.params["name_prefix"] + "captured ", error))
    try:
        policy = Policy.from_mapping(module.params["policy"], module.params["name_prefix"])
        check_policy_fits(facts["limits"], policy, module.params["name_prefix"])
    except (TypeError, ValueError) as error:
        module.fail_json(msg="invalid sizing policy: %s" % error)
    result, error, text = None, None, render_facts(facts)
    try:
        result = plan(facts, policy)
        text += "\n\n" + render_plan(result)
    except PlanError as failure:
        error = str(failure)
        text += "\n\nno plan: " + error
    tuning = probe_tuning()
    found = {
        "vlserve_facts": facts,
        "vlserve_tuning": tuning,
        "vlserve_plan": result,
        "vlserve_plan_error": error,
        "vlserve_plan_text": text,
        # Knobs whose running state differs from the plan: what the tuning roles re-apply.
        "vlserve_runtime_drift": runtime_drift(facts, result, tuning) if result is not None else [],
        # Where the tuning roles write (and the audit reads).
        "vlserve_tuning_files": TUNING_FILES,
    }
    if module.params["audit"] and result is not None:
        rows = audit(facts, result, tuning)
        found.update(vlserve_audit=rows, vlserve_audit_summary=summary(rows), vlserve_audit_text=render(rows))
    module.exit_json(changed=False, ansible_facts=found)


if __name__ == "__main__":
    main()
