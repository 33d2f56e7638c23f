"""Properties of the planner over generated topologies (hypothesis)."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from topology_builder import build_facts
from vlserve import sizing
from vlserve.sizing import cores, fitting

ISA_SETS = [
    (),
    ("avx2",),
    ("avx2", "avx512f", "avx512_vnni"),
    ("avx2", "avx512f", "avx512_bf16"),
    ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),
]


@st.composite
def hosts(draw):
    sockets = draw(st.integers(1, 4))
    nodes_per_socket = draw(st.sampled_from([1, 2, 4]))
    cores_per_socket = nodes_per_socket * draw(st.integers(1, 24))
    threads = draw(st.sampled_from([1, 2]))
    physical = sockets * cores_per_socket
    efficiency = draw(st.integers(0, physical - 1)) if sockets == 1 and draw(st.booleans()) else 0
    total = draw(st.floats(2, 1024))
    facts = build_facts(
        hostname="generated",
        model_name="generated",
        sockets=sockets,
        cores_per_socket=cores_per_socket,
        threads_per_core=threads,
        nodes_per_socket=nodes_per_socket,
        efficiency_cores=efficiency,
        isa=draw(st.sampled_from(ISA_SETS)),
        total_gib=total,
        available_gib=total * draw(st.floats(0.1, 0.98)),
        cpu_quota=draw(st.none() | st.floats(0.5, physical * threads)),
        cpufreq=draw(st.sampled_from([None, "intel_pstate", "acpi-cpufreq"])),
    )
    cpus = [e["cpu"] for e in facts["cpu"]["topology"]]
    allowed = draw(st.none() | st.lists(st.sampled_from(cpus), min_size=1, unique=True))
    if allowed is not None:
        facts["limits"]["allowed_cpus"] = facts["limits"]["affinity"] = sorted(allowed)
        facts["limits"]["cgroup_cpuset"] = sorted(allowed)
    return facts


policies = st.builds(
    sizing.Policy,
    objective=st.sampled_from(["throughput", "latency"]),
    min_threads_per_worker=st.integers(1, 16),
    max_workers=st.none() | st.integers(1, 64),
    housekeeping_cores=st.none() | st.integers(0, 3),
    max_batch_size=st.integers(1, 16),
    max_context_tokens=st.sampled_from([2048, 4096, 32768]),
    quantize=st.sampled_from(["auto", "none", "int8", "int4"]),
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def plan_or_none(facts, policy):
    try:
        return sizing.plan(facts, policy)
    except sizing.PlanError:
        return None


@SETTINGS
@given(hosts(), policies)
def test_threads_never_exceed_usable_physical_cores(facts, policy):
    result = plan_or_none(facts, policy)
    assume(result is not None)
    threads = sum(w["threads"] for w in result["worker_list"])
    assert threads == sum(len(w["cpus"]) for w in result["worker_list"])
    assert threads <= len(result["cores"]["usable"])
    quota = facts["limits"]["cpu_quota_cpus"]
    if quota is not None:
        assert threads <= quota
    # One logical CPU per physical core, never an E-core, never outside the allowed set.
    core_of = {e["cpu"]: tuple(e["core_cpus"]) for e in facts["cpu"]["topology"]}
    torch_cpus = [c for w in result["worker_list"] for c in w["cpus"]]
    assert len({core_of[c] for c in torch_cpus}) == len(torch_cpus)
    assert not set(torch_cpus) & set(facts["cpu"]["efficiency_cpus"])
    assert set(torch_cpus) <= set(facts["limits"]["allowed_cpus"])


@SETTINGS
@given(hosts(), policies)
def test_worker_memory_never_exceeds_the_budget(facts, policy):
    result = plan_or_none(facts, policy)
    assume(result is not None)
    memory = result["memory"]
    count = result["workers"]["count"]
    assert count * memory["per_worker"]["high_bytes"] <= memory["available_bytes"]
    assert memory["available_bytes"] + memory["reserve_bytes"] <= max(
        facts["memory"]["available_bytes"], facts["memory"]["total_bytes"]
    )
    assert result["model"]["max_batch_size"] <= policy.max_batch_size
    assert result["model"]["max_context_tokens"] <= policy.max_context_tokens


@SETTINGS
@given(hosts(), policies)
def test_no_worker_spans_numa_nodes_and_cpu_lists_are_disjoint(facts, policy):
    result = plan_or_none(facts, policy)
    assume(result is not None)
    node_of = {e["cpu"]: e["node"] for e in facts["cpu"]["topology"]}
    seen = set()
    for worker in result["worker_list"]:
        assert {node_of[c] for c in worker["cpus"]} == {worker["numa_node"]}
        mine = set(worker["cpus"]) | set(worker["sibling_cpus"])
        assert not mine & seen
        seen |= mine
    if policy.objective == "latency":
        nodes = [w["numa_node"] for w in result["worker_list"]]
        assert len(nodes) == len(set(nodes))
    ports = [w["port"] for w in result["worker_list"]]
    assert len(set(ports)) == len(ports)


@SETTINGS
@given(hosts(), policies)
def test_memory_for_speed_trades_never_cost_a_worker(facts, policy):
    result = plan_or_none(facts, policy)
    assume(result is not None)
    model = result["model"]
    policy = sizing.Policy(**result["policy"])
    budget = fitting.plan_memory_budget(facts["memory"], facts["limits"], policy, facts["platform"])
    bare = sizing.worker_memory(
        sizing.FOOTPRINTS[policy.model],
        model["dtype"],
        model["max_batch_size"],
        model["max_context_tokens"],
        quantize=model["quantize"],
    )
    by_node = cores.plan_cores(facts["cpu"], facts["limits"], policy)["by_node"]
    without = cores.place_workers(by_node, policy, budget["available_bytes"] // bare["high_bytes"])
    assert result["workers"]["count"] >= len(without)  # an int8 vision tower even saves memory
    if model["prefill_dtype"] not in (model["dtype"], model["quantize"], "int8"):
        # a float32 prompt copy lives in the service's own layers: packed, or plain bfloat16 on x86
        assert model["packed_weights"] or (model["dtype"] == "bfloat16" and facts["cpu"]["arch"] == "x86_64")


@SETTINGS
@given(hosts(), policies)
def test_plan_is_deterministic_and_does_not_touch_its_input(facts, policy):
    before = copy.deepcopy(facts)
    first = plan_or_none(facts, policy)
    assert facts == before
    assert plan_or_none(copy.deepcopy(facts), policy) == first


@SETTINGS
@given(hosts(), policies)
def test_infeasible_only_when_one_minimal_worker_does_not_fit(facts, policy):
    try:
        sizing.plan(facts, policy)
    except sizing.PlanError as error:
        text = str(error)
        assert "leaves" in text or "no usable core" in text
        if "leaves" in text:
            budget = fitting.plan_memory_budget(facts["memory"], facts["limits"], policy, facts["platform"])
            levels = sizing.auto_levels(facts["cpu"])[0] if policy.quantize == "auto" else (policy.quantize,)
            smallest = sizing.worker_memory(
                sizing.FOOTPRINTS[policy.model],
                "bfloat16",
                1,
                min(policy.max_context_tokens, sizing.MIN_CONTEXT_TOKENS),
                quantize=levels[-1],
            )
            assert smallest["high_bytes"] > budget["available_bytes"]


@SETTINGS
@given(hosts(), policies, st.data())
def test_the_plan_holds_still_while_other_processes_come_and_go(facts, policy, data):
    """Free memory, the cgroup's usage and what our own slice holds move with the host's load; a plan
    that followed them would restart the workers on every re-run."""
    before = plan_or_none(facts, policy)
    moved = copy.deepcopy(facts)
    total = moved["memory"]["total_bytes"]
    moved["memory"]["available_bytes"] = data.draw(st.integers(0, total))
    moved["limits"]["memory_usage_bytes"] = data.draw(st.none() | st.integers(0, total))
    moved["limits"]["vlserve_slice_bytes"] = data.draw(st.none() | st.integers(0, total))
    assert plan_or_none(moved, policy) == before
