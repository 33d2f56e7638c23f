"""The planner on captured topologies: each asserts the plan and the reasons it gives."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import REPO, TOPOLOGIES, load_topology
from vlserve import sizing

ALL = sorted(p.stem for p in TOPOLOGIES.glob("*.json"))


def test_at_least_ten_topologies():
    assert len(ALL) >= 10, ALL


@pytest.mark.parametrize("name", ALL)
def test_fixture_matches_facts_schema(name, facts_schema):
    jsonschema.validate(load_topology(name), facts_schema)


@pytest.mark.parametrize("name", ALL)
def test_plan_matches_schema_and_every_section_says_why(name, plan_schema):
    try:
        result = sizing.plan(load_topology(name))
    except sizing.PlanError as error:
        result = {"schema": sizing.PLAN_SCHEMA, "error": str(error)}
    jsonschema.validate(result, plan_schema)
    if "error" not in result:
        for section in ("model", "cores", "memory", "workers"):
            assert result[section]["why"], section


def workers_of(result):
    return [(w["numa_node"], w["cpus"]) for w in result["worker_list"]]


def test_xeon_gold_two_sockets_five_threads_per_worker():
    result = sizing.plan(load_topology("xeon-gold-6248r-2s"))
    # No native bfloat16, but decoding is memory-bound: bfloat16 weights, float32 for prompts and images.
    assert result["model"]["dtype"] == "bfloat16"
    assert result["model"]["why"].startswith("no AVX-512 BF16 or AMX, but a decode step reads half the bytes")
    assert (result["model"]["prefill_dtype"], result["model"]["vision_dtype"]) == ("float32", "float32")
    assert not result["model"]["packed_weights"]
    # 32 physical cores, one housekeeping core per node: 15 per node -> 3 workers of 5 threads each.
    assert result["cores"]["housekeeping"] == [0, 16]
    assert result["workers"]["count"] == 6
    assert result["workers"]["threads"] == [5] * 6
    assert workers_of(result)[:3] == [(0, [1, 2, 3, 4, 5]), (0, [6, 7, 8, 9, 10]), (0, [11, 12, 13, 14, 15])]
    assert {node for node, _ in workers_of(result)} == {0, 1}
    assert result["workers"]["numa_bind"] is True
    assert "memory allows 9" in result["workers"]["why"]  # 192 GiB less the 9.6 GiB reserve
    # SMT siblings (32-63) are never torch CPUs; each worker may use its own cores' siblings.
    assert result["worker_list"][0]["sibling_cpus"] == [33, 34, 35, 36, 37]
    assert result["knobs"]["cpu_governor"] == {
        "value": "performance",
        "applies": True,
        "configure": True,
        "why": "steady clocks: ondemand/powersave ramp up too late for bursts",
    }
    isolation = result["knobs"]["cpu_isolation"]
    assert isolation["applies"] and isolation["value"]["memory_nodes"] == [0, 1]
    assert isolation["value"]["cpus"] == list(range(1, 16)) + list(range(17, 32)) + list(range(33, 48)) + list(
        range(49, 64)
    )
    assert result["knobs"]["energy_performance_preference"]["applies"] is True
    assert result["knobs"]["swappiness"]["value"] == 10  # a disk swap partition exists
    assert "swap on a disk" in result["knobs"]["swappiness"]["why"]


def test_e5_2680v4_avx2_only():
    result = sizing.plan(load_topology("xeon-e5-2680v4"))
    assert (result["model"]["dtype"], result["model"]["prefill_dtype"]) == ("bfloat16", "float32")
    assert result["workers"]["threads"] == [5, 4, 4]
    assert result["cores"]["usable"] == list(range(1, 14))
    assert result["knobs"]["energy_performance_preference"]["applies"] is False
    assert result["knobs"]["swappiness"]["value"] == 180  # zram will be the only swap
    assert result["knobs"]["page_cluster"]["value"] == 0


@pytest.mark.parametrize("isa", ["as is", "avx2 only"])
def test_an_8_gib_laptop_with_a_desktop_running_gets_a_worker_at_a_smaller_level(isa):
    facts = load_topology("i7-11800h-laptop-8g")
    if isa == "avx2 only":
        facts["cpu"]["isa"].update(avx512f=False, avx512_vnni=False, avx512_bf16=False)
    # int8 is next on every ISA whose accuracy is established: more accurate than int4 and, through
    # vlserve's Q8_0 kernel, the faster to decode on AVX2 too (docs/quantization.md).
    level = "int8"
    desktop = sizing.Policy(other_services_bytes=int(1.8 * sizing.GIB))  # 4.8 GiB left for workers
    with pytest.raises(sizing.PlanError, match="or take quantize: %s, with which one worker fits" % level):
        sizing.plan(facts, sizing.Policy(other_services_bytes=desktop.other_services_bytes, quantize="none"))
    result = sizing.plan(facts, desktop)
    assert result["model"]["quantize"] == level and result["workers"]["count"] == 1
    assert result["worker_list"][0]["memory_high_bytes"] <= result["memory"]["available_bytes"]
    assert not result["model"]["packed_weights"]
    assert (
        "accuracy established on %s" % ("AVX2" if isa == "avx2 only" else "AVX-512 VNNI")
        in result["model"]["quantize_why"]
    )
    assert result["model"]["prefill_dtype"] == "int8"  # the int8 weights themselves
    # Tighter still, int4.
    tighter = sizing.plan(facts, sizing.Policy(other_services_bytes=int(2.3 * sizing.GIB)))
    assert tighter["model"]["quantize"] == "int4"
    assert tighter["worker_list"][0]["memory_high_bytes"] < result["worker_list"][0]["memory_high_bytes"]


def test_the_default_stays_exact_wherever_one_worker_fits():
    for name in ("xeon-avx512bf16-2vcpu-vm", "i7-11800h-laptop-8g", "cloud-vm-2vcpu", "xeon-e5-2680v4"):
        result = sizing.plan(load_topology(name))
        assert result["model"]["quantize"] == "none", name
        assert result["model"]["quantize_why"] == "auto: exact weights, one worker fits"


def test_each_level_counts_its_own_weights():
    footprint = sizing.FOOTPRINTS["qwen3-vl-2b-instruct"]
    sizes = {
        level: sizing.worker_memory(footprint, "bfloat16", 1, 2048, quantize=level)["weights_bytes"]
        for level in ("none", "int8", "int4")
    }
    linear, head = footprint.text_linear_parameters, footprint.tied_head_parameters
    # Q8_0: 34 bytes per 32 weights (the head too, at both levels); int4: 20 bytes per 32.
    assert sizes["none"] - sizes["int8"] == 2 * linear - linear * 34 // 32 - head * 34 // 32
    assert sizes["int8"] - sizes["int4"] == linear * 34 // 32 - linear * 20 // 32


def test_small_laptop_shrinks_the_batch_and_leaves_out_the_float32_copies():
    result = sizing.plan(load_topology("i7-11800h-laptop-8g"))
    assert result["model"]["dtype"] == "bfloat16"
    # 7.7 GiB of RAM less the 1 GiB reserve, whatever the desktop holds at the moment: no room for the
    # float32 prompt copy (5.6 GB) nor, at batch 2, for a float32 vision tower.
    assert result["model"]["prefill_dtype"] == result["model"]["vision_dtype"] == "bfloat16"
    assert "would cost the batch or a worker" in result["model"]["prefill_why"]
    assert result["model"]["max_batch_size"] == 2
    assert "does not fit" in result["model"]["batch_why"]
    assert result["workers"]["count"] == 1
    assert result["worker_list"][0]["cpus"] == [1, 2, 3, 4, 5, 6, 7]
    worker = result["worker_list"][0]
    assert worker["memory_high_bytes"] <= result["memory"]["available_bytes"]


def test_epyc_nps4_workers_never_span_nodes():
    facts = load_topology("epyc-7763-2s-nps4")
    result = sizing.plan(facts)
    assert len(facts["cpu"]["numa_nodes"]) == 8
    assert result["workers"]["count"] == 24
    assert len(result["cores"]["housekeeping"]) == 8
    node_of = {e["cpu"]: e["node"] for e in facts["cpu"]["topology"]}
    for worker in result["worker_list"]:
        assert {node_of[c] for c in worker["cpus"]} == {worker["numa_node"]}
    assert sizing.plan(facts, sizing.Policy(objective="latency"))["workers"]["threads"] == [15] * 8


def test_sapphire_rapids_amx_gives_bfloat16():
    result = sizing.plan(load_topology("sapphire-rapids-amx"))
    assert result["model"]["dtype"] == "bfloat16"
    assert result["model"]["why"].startswith("the CPU has AMX")
    assert result["workers"]["count"] == 13
    assert sum(result["workers"]["threads"]) == 55
    assert result["worker_list"][0]["environment"]["VLSERVE_DTYPE"] == "bfloat16"
    # AMX makes bfloat16 products the fast ones: no float32 copies for prompts or the vision tower.
    assert (result["model"]["prefill_dtype"], result["model"]["vision_dtype"]) == ("bfloat16", "bfloat16")
    assert result["worker_list"][0]["environment"]["VLSERVE_PREFILL_DTYPE"] == "bfloat16"


def test_hybrid_laptop_leaves_out_e_cores():
    facts = load_topology("alder-lake-hybrid-laptop")
    result = sizing.plan(facts)
    assert facts["cpu"]["efficiency_cpus"] == list(range(6, 14))
    assert "8 E-core CPUs left out" in result["cores"]["why"]
    assert not set(result["cores"]["usable"]) & set(facts["cpu"]["efficiency_cpus"])
    assert result["worker_list"][0]["cpus"] == [1, 2, 3, 4, 5]
    assert result["worker_list"][0]["sibling_cpus"] == [15, 16, 17, 18, 19]
    # 16 GiB less the 1 GiB reserve: bfloat16 weights (no native bfloat16 on Alder Lake, but half the
    # bytes per token) with the float32 prompt copy, unpacked (oneDNN's packing needs AVX-512 BF16).
    assert result["model"]["dtype"] == "bfloat16"
    assert result["memory"]["available_bytes"] == result["memory"]["total_bytes"] - sizing.GIB
    assert not result["model"]["packed_weights"] and result["model"]["prefill_dtype"] == "float32"


def test_wsl2_with_6_gib_cannot_run_and_says_how_to_fix_it():
    # The binding limit is the VM's memory=: the message says which line to write.
    # At exact weights, that is; the plan then names the level with which one worker fits.
    exact = sizing.Policy(quantize="none")
    with pytest.raises(
        sizing.PlanError, match=r"set memory=7GB under \[wsl2\] in .*\.wslconfig.*; or take quantize: int8, with which"
    ):
        sizing.plan(load_topology("wsl2-8cpu-6g"), exact)
    # On auto it takes that level itself, and says why.
    rounded = sizing.plan(load_topology("wsl2-8cpu-6g"))
    assert rounded["model"]["quantize"] == rounded["worker_list"][0]["environment"]["VLSERVE_QUANTIZE"] == "int8"
    assert rounded["model"]["quantize_why"].startswith("auto: int8, as the exact weights do not fit (one ")
    # With the limit raised, it plans, and the host knobs that WSL lacks are "not applicable".
    facts = load_topology("wsl2-8cpu-6g")
    facts["memory"]["total_bytes"] = facts["memory"]["available_bytes"] = 12 * sizing.GIB
    result = sizing.plan(facts, exact)
    knobs = result["knobs"]
    assert knobs["wsl"]["applies"] is True
    # .wslconfig must give the distribution at least what the plan uses, rounded up to whole GiB.
    assert knobs["wsl"]["value"]["memory_bytes"] == 12 * sizing.GIB
    assert knobs["wsl"]["value"]["processors"] == 8
    assert knobs["zram"]["applies"] is False and "wslconfig" in knobs["zram"]["why"]
    assert knobs["cpu_governor"]["applies"] is False and "no cpufreq" in knobs["cpu_governor"]["why"]


def test_container_quota_caps_threads_and_housekeeping_comes_from_the_idle_cpus():
    result = sizing.plan(load_topology("container-quota-2.5-of-16"))
    assert result["workers"]["count"] == 1
    assert result["worker_list"][0]["cpus"] == [1, 2]
    assert "CPU quota 2.50 caps it at 2" in result["cores"]["why"]
    assert result["memory"]["available_why"] == "the cgroup's memory limit (memory.max)"
    assert result["memory"]["capacity_source"] == "cgroup"
    for name in ("cpu_governor", "zram", "swappiness", "page_cluster", "cpu_isolation"):
        assert result["knobs"][name]["applies"] is False, name
    # Written for when the image boots on a real host, though a container cannot apply it.
    assert result["knobs"]["swappiness"]["configure"] is True
    assert result["knobs"]["zram"]["configure"] is False


def test_two_vcpu_cloud_vm_one_thread_and_no_cpufreq():
    result = sizing.plan(load_topology("cloud-vm-2vcpu"))
    assert result["worker_list"][0]["cpus"] == [0]
    assert result["worker_list"][0]["sibling_cpus"] == [1]
    assert result["worker_list"][0]["environment"]["OMP_NUM_THREADS"] == "1"
    assert result["model"]["dtype"] == "bfloat16"
    assert result["model"]["max_batch_size"] == 2
    assert result["knobs"]["cpu_governor"]["applies"] is False
    assert "no cpufreq here (amazon)" in result["knobs"]["cpu_governor"]["why"]
    assert result["knobs"]["zram"]["applies"] is True


def test_this_machine_capture():
    result = sizing.plan(load_topology("xeon-avx512bf16-2vcpu-vm"))
    assert result["model"]["dtype"] == "bfloat16"
    assert result["worker_list"][0]["cpus"] == [0, 1]
    assert result["worker_list"][0]["environment"]["OMP_PLACES"] == "{0},{1}"
    assert "fewer than 4 cores" in result["cores"]["why"]
    # AVX-512 BF16 without AMX, 23 GiB: bf16 packed decode, float32 prompts and vision tower.
    model = result["model"]
    assert (model["packed_weights"], model["vision_dtype"], model["prefill_dtype"]) == (True, "float32", "float32")
    assert result["worker_list"][0]["environment"]["VLSERVE_PREFILL_DTYPE"] == "float32"
    footprint = sizing.FOOTPRINTS["qwen3-vl-2b-instruct"]
    copy_bytes = footprint.text_linear_parameters * 4
    with_copy = result["memory"]["per_worker"]["weights_bytes"]
    assert (
        with_copy
        == sizing.worker_memory(footprint, "bfloat16", 1, 2048, packed=True, vision_dtype="float32")["weights_bytes"]
        + copy_bytes
    )


def test_amd_avx512_bf16_takes_bfloat16_products_and_no_float32_copies():
    """The same ISA as the Xeon capture above, on AMD: there bfloat16 products are the fast ones, so
    `none` keeps one bfloat16 copy of the weights and the worker fits in less than half the memory."""
    amd = sizing.plan(load_topology("epyc-zen4-avx512bf16-2vcpu-vm"))
    intel = sizing.plan(load_topology("xeon-avx512bf16-2vcpu-vm"))
    model = amd["model"]
    assert (model["dtype"], model["vision_dtype"], model["prefill_dtype"]) == ("bfloat16", "bfloat16", "bfloat16")
    assert model["prefill_why"].startswith("AVX-512 BF16 on AMD: bfloat16 matrix products are the fast ones")
    assert amd["worker_list"][0]["environment"]["VLSERVE_VISION_DTYPE"] == "bfloat16"
    footprint = sizing.FOOTPRINTS["qwen3-vl-2b-instruct"]
    float32_copies = footprint.text_linear_parameters * 4 + footprint.vision_parameters * 2
    assert (
        intel["memory"]["per_worker"]["weights_bytes"] - amd["memory"]["per_worker"]["weights_bytes"] == float32_copies
    )
    # At a quantize level the int8 products stay: they outrun bfloat16 ones on AMD too (1.1-1.4x).
    int8 = sizing.plan(load_topology("epyc-zen4-avx512bf16-2vcpu-vm"), sizing.Policy(quantize="int8"))["model"]
    assert (int8["vision_dtype"], int8["prefill_dtype"]) == ("int8", "int8")


def test_quantize_int8_rounds_the_language_model_and_the_vision_tower():
    facts = load_topology("xeon-avx512bf16-2vcpu-vm")  # AVX-512 VNNI
    default = sizing.plan(facts)
    quantized = sizing.plan(facts, sizing.Policy(quantize="int8"))
    model = quantized["model"]
    assert (model["dtype"], model["vision_dtype"], model["prefill_dtype"]) == ("bfloat16", "int8", "int8")
    assert (model["quantize"], model["packed_weights"]) == ("int8", False)
    assert model["quantize_why"] == "set by policy; accuracy established on AVX-512 VNNI (docs/quantization.md)"
    assert "numerics change" in model["vision_why"] and "no copy" in model["prefill_why"]
    env = quantized["worker_list"][0]["environment"]
    assert (env["VLSERVE_VISION_DTYPE"], env["VLSERVE_PREFILL_DTYPE"], env["VLSERVE_QUANTIZE"]) == ("int8",) * 3
    # Exact: packed bf16 decoder + its packed head + float32 prompt copy + float32 vision tower. int8: the
    # decoder's layers in Q8_0 (prompts on them too: 34 bytes per 32 weights), a Q8_0 head and vision tower.
    footprint = sizing.FOOTPRINTS["qwen3-vl-2b-instruct"]
    saved = default["memory"]["per_worker"]["weights_bytes"] - quantized["memory"]["per_worker"]["weights_bytes"]
    q8 = sizing.COMPUTE_BYTES_PER_32["int8"]
    assert saved == (
        footprint.text_linear_parameters * (6 * 32 - q8) // 32
        + footprint.vision_parameters * (4 * 32 - q8) // 32
        + footprint.tied_head_parameters * (2 * 32 - q8) // 32
    )
    # VNNI without BF16 (Cascade Lake): bfloat16 for the rest, int8 images and prompts.
    cascade = sizing.plan(load_topology("xeon-gold-6248r-2s"), sizing.Policy(quantize="int8"))["model"]
    assert (cascade["dtype"], cascade["packed_weights"]) == ("bfloat16", False)
    assert (cascade["vision_dtype"], cascade["prefill_dtype"]) == ("int8", "int8")
    # AVX2 without VNNI: int8 products still beat float32 ones on images and prompts (measured 2.2x).
    old = sizing.plan(load_topology("xeon-e5-2680v4"), sizing.Policy(quantize="int8"))
    assert (old["model"]["vision_dtype"], old["model"]["prefill_dtype"]) == ("int8", "int8")
    # int4 with VNNI: an int8 copy for prompts, for accuracy (int4 prompts doubled the KL divergence).
    int4 = sizing.plan(facts, sizing.Policy(quantize="int4"))["model"]
    assert (int4["quantize"], int4["prefill_dtype"], int4["vision_dtype"]) == ("int4", "int8", "int8")
    broadwell = load_topology("xeon-e5-2680v4")
    assert sizing.plan(broadwell, sizing.Policy(quantize="int4"))["model"]["prefill_dtype"] == "int8"
    # Without even AVX2, prompts stay on the int4 weights.
    broadwell["cpu"]["isa"]["avx2"] = False
    assert sizing.plan(broadwell, sizing.Policy(quantize="int4"))["model"]["prefill_dtype"] == "int4"


def test_policy_overrides_are_honoured_and_reported():
    facts = load_topology("xeon-gold-6248r-2s")
    result = sizing.plan(facts, sizing.Policy(max_workers=2, dtype="bfloat16", housekeeping_cores=0, swappiness=30))
    assert result["workers"]["count"] == 2
    assert "max_workers caps at 2" in result["workers"]["why"]
    assert [w["numa_node"] for w in result["worker_list"]] == [0, 1]  # balanced across nodes
    assert result["workers"]["threads"] == [16, 16]
    assert result["model"]["why"] == "set by policy"
    assert result["knobs"]["swappiness"] == {"value": 30, "applies": True, "configure": True, "why": "set by policy"}


def test_allowed_cpus_outside_the_host_are_refused():
    with pytest.raises(ValueError, match="allowed_cpus has CPUs 7 that this host does not allow"):
        sizing.plan(load_topology("xeon-avx512bf16-2vcpu-vm"), sizing.Policy(allowed_cpus=[0, 7]))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"objective": "fastest"}, "objective must be throughput or latency"),
        ({"quantize": "int2"}, "quantize must be auto, none, int8 or int4"),
        ({"swappiness": 500}, "swappiness must be empty or an integer from 0 to 200"),
        ({"zram_fraction": "lots"}, "zram_fraction must be a number"),
        ({"allowed_cpus": "0-x"}, "allowed_cpus must be a CPU list"),
        ({"nonsense": 1}, "unknown policy fields: nonsense"),
    ],
)
def test_bad_policy_values_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        sizing.Policy.from_mapping(values)


def test_policy_from_text_values_as_extra_vars_give_them():
    policy = sizing.Policy.from_mapping({"max_workers": "3", "zram_fraction": "0.25", "allowed_cpus": "0-3,8"})
    assert (policy.max_workers, policy.zram_fraction, policy.allowed_cpus) == (3, 0.25, [0, 1, 2, 3, 8])


def test_footprint_matches_the_architecture_make_test_model_writes():
    """The planner's figures for Qwen3-VL-2B and the `--size real` checkpoint describe one model."""
    import torch  # noqa: PLC0415
    from transformers import Qwen3VLForConditionalGeneration  # noqa: PLC0415

    from vlserve.model.testmodel import model_config  # noqa: PLC0415

    config, _ = model_config("real")
    with torch.device("meta"):  # shapes only: no memory for 2 B parameters
        model = Qwen3VLForConditionalGeneration(config)
    footprint = sizing.FOOTPRINTS["qwen3-vl-2b-instruct"]
    text = config.text_config
    decoder = model.model.language_model
    assert footprint.text_layers == text.num_hidden_layers
    assert footprint.kv_heads == text.num_key_value_heads
    assert footprint.head_dim == text.head_dim
    assert footprint.tied_head_parameters == decoder.embed_tokens.weight.numel()
    linear = sum(m.weight.numel() for m in decoder.modules() if isinstance(m, torch.nn.Linear))
    assert footprint.text_linear_parameters == linear
    # Rounded in FOOTPRINTS (2.128 B, 0.407 B): within 0.1%.
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert abs(footprint.parameters - total) <= total / 1000
    assert abs(footprint.vision_parameters - vision) <= vision / 1000


def test_graviton3_bfloat16_from_arm_features_and_no_x86_only_paths():
    result = sizing.plan(load_topology("graviton3-c7g-16"), sizing.Policy(quantize="int8"))
    model = result["model"]
    assert (model["dtype"], model["why"]) == (
        "bfloat16",
        "the CPU has Arm BF16 (bf16): half the memory traffic per token",
    )
    exact = sizing.plan(load_topology("graviton3-c7g-16"))["model"]
    assert not exact["packed_weights"] and "oneDNN's x86" in exact["packed_why"]
    assert exact["prefill_dtype"] == "bfloat16"
    # The int8 products with int8 inputs are x86 kernels: the vision tower is not rounded, and the plan
    # says why; the language model's int8 weights go through torch's weight-only kernel.
    assert model["vision_dtype"] == "float32" and "its int8 products are vlserve's x86 kernels" in model["vision_why"]
    assert model["prefill_dtype"] == "int8" and "weight-only" in model["prefill_why"]


def test_ampere_altra_without_bf16_runs_float32_and_says_so_in_arm_terms():
    result = sizing.plan(load_topology("ampere-altra-q80"))
    assert result["model"]["dtype"] == "float32"
    assert result["model"]["why"] == "no Arm BF16 (bf16): bfloat16 would be emulated"
    assert result["knobs"]["cpu_governor"]["applies"]  # cppc_cpufreq offers performance


def test_kernels_before_5_8_get_at_most_100_swappiness():
    for name, release in (("ubuntu2004-kernel-5.4", "5.4"), ("rhel8-kernel-4.18", "4.18")):
        knob = sizing.plan(load_topology(name))["knobs"]["swappiness"]
        assert knob["value"] == 100, name
        assert "100, the most Linux %s accepts (above 100 needs 5.8)" % release in knob["why"]
    # An operator's value above 100 is capped the same way, and left alone on newer kernels.
    assert (
        sizing.plan(load_topology("rhel8-kernel-4.18"), sizing.Policy(swappiness=150))["knobs"]["swappiness"]["value"]
        == 100
    )
    assert sizing.plan(load_topology("graviton3-c7g-16"))["knobs"]["swappiness"]["value"] == 180


def test_zram_takes_an_algorithm_the_kernel_lists():
    knob = sizing.plan(load_topology("rhel8-kernel-4.18"))["knobs"]["zram"]
    assert knob["value"]["algorithm"] == "lz4" and "lz4, as this kernel's zram offers no zstd" in knob["why"]
    facts = load_topology("rhel8-kernel-4.18")
    facts["memory"]["zram"]["algorithms"] = ["842", "deflate"]
    knob = sizing.plan(facts)["knobs"]["zram"]
    assert not knob["applies"] and "offers none of zstd, lz4, lzo-rle, lzo" in knob["why"]


def test_no_performance_governor_on_the_driver_leaves_cpufreq_alone():
    facts = load_topology("xeon-e5-2680v4")
    facts["cpufreq"]["available_governors"] = ["ondemand", "conservative"]
    knobs = sizing.plan(facts)["knobs"]
    assert not knobs["cpu_governor"]["applies"] and "offers no performance governor" in knobs["cpu_governor"]["why"]


def test_the_footprints_hold_what_a_worker_measured():
    """`vlserve bench-footprint` on the real-size checkpoint, recorded in
    tests/fixtures/measured-footprints.json: at each level the plan for the measured host budgets at
    least what its worker held (the load's peak, settled, once it had served a batch of image
    requests, the peak while serving), and no more than a quarter above what it held once it had
    served. A change to the footprints or to the dtypes a level takes there is re-measured."""
    from vlserve.bench.footprint import budget_of, misses  # noqa: PLC0415

    runs = json.loads((REPO / "tests" / "fixtures" / "measured-footprints.json").read_text())["runs"]
    levels = [(run["facts"], level) for run in runs for level in run["levels"]]
    assert len(runs) >= 2 and {level["level"] for _, level in levels} == set(sizing.QUANTIZE_LEVELS)
    for facts, level in levels:
        plan = sizing.plan(facts, sizing.Policy(quantize=level["level"], max_workers=1))
        assert {key: plan["model"][key] for key in level["dtypes"]} == level["dtypes"], "re-measure: dtypes moved"
        budget = budget_of(plan)
        assert not misses({**level, "plan": budget}), level["level"]
        assert budget["served_bytes"] <= 1.25 * level["measured"]["served_bytes"], level["level"]
