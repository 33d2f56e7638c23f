"""What a worker loads the model as: a hand-started worker on `auto` makes the plan's choices."""

from __future__ import annotations

import pytest

from conftest import TOPOLOGIES, load_topology, vm_flags_at
from vlserve import sizing
from vlserve.model.loader import choose
from vlserve.settings import LimitSettings, ModelSettings

ALL = [p.stem for p in sorted(TOPOLOGIES.glob("*.json"))]


@pytest.mark.parametrize("name", ALL)
def test_auto_takes_what_a_deployed_worker_of_the_same_batch_takes(name):
    facts = load_topology(name)
    limits = LimitSettings(max_batch_size=2, max_context_tokens=4096)
    chosen = choose(ModelSettings(), limits, facts)
    plan = sizing.plan(
        facts, sizing.Policy(objective="latency", max_workers=1, max_batch_size=2, max_context_tokens=4096)
    )
    environment = plan["worker_list"][0]["environment"]
    assert (chosen.dtype, chosen.vision_dtype, chosen.prefill_dtype, chosen.packed, chosen.quantize) == (
        environment["VLSERVE_DTYPE"],
        environment["VLSERVE_VISION_DTYPE"],
        environment["VLSERVE_PREFILL_DTYPE"],
        environment["VLSERVE_PACKED_WEIGHTS"] == "true",
        environment["VLSERVE_QUANTIZE"],
    )
    assert chosen.threads == sizing.default_threads(facts)


def test_auto_refuses_the_float32_prompt_copy_where_the_plan_does():
    """The 8 GB laptop: bfloat16 emulated, no room for a 5.6 GB float32 copy of the decoder."""
    facts = load_topology("i7-11800h-laptop-8g")
    chosen = choose(ModelSettings(), LimitSettings(), facts)
    assert chosen.dtype == "bfloat16"
    assert chosen.prefill_dtype == "bfloat16" and chosen.vision_dtype == "bfloat16"
    assert "the sizing plan for this process" in chosen.why


def test_explicit_settings_win_over_the_plan():
    facts = load_topology("xeon-avx512bf16-2vcpu-vm")
    settings = ModelSettings(dtype="float32", vision_dtype="int8", prefill_dtype="float32", packed_weights=False)
    chosen = choose(settings, LimitSettings(), facts)
    assert (chosen.dtype, chosen.vision_dtype, chosen.prefill_dtype, chosen.packed) == (
        "float32",
        "int8",
        "float32",
        False,
    )


def test_a_host_the_plan_refuses_still_loads_without_extra_copies():
    chosen = choose(ModelSettings(quantize="none"), LimitSettings(), load_topology("wsl2-8cpu-6g"))
    assert chosen.vision_dtype == chosen.prefill_dtype == chosen.dtype and not chosen.packed
    assert chosen.quantize == "none"
    assert chosen.why.startswith("no extra copies: one Qwen3-VL-2B-Instruct worker needs")


def _resident_bytes_of(path) -> int:
    """This process's resident bytes of `path`'s mappings (smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(maxsplit=1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_a_table_read_by_rows_in_the_checkpoint_map_is_advised_random(tmp_path):
    """MADV_RANDOM (smaps' "rr"): a row that left the page cache is read alone, not with the device's
    read-ahead window; anonymous memory is left alone and the values are the file's."""
    import mmap  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from vlserve.model import mapped  # noqa: PLC0415

    path = tmp_path / "model.safetensors"
    original = torch.randn(4096, 512).bfloat16()  # 4 MiB: rows of 1 KiB
    save_file({"before": torch.zeros(3), "table": original}, path)
    with safe_open(path, framework="pt") as checkpoint:
        table = checkpoint.get_tensor("table")
    middle = table.data_ptr() + table.nbytes // 2
    assert "rr" not in vm_flags_at(middle)
    advised = mapped.read_by_rows(table)
    assert table.nbytes - 2 * mmap.PAGESIZE <= advised <= table.nbytes
    assert "rr" in vm_flags_at(middle) and torch.equal(table, original)
    copy = table.clone()
    assert mapped.read_by_rows(copy) == 0 and "rr" not in vm_flags_at(copy.data_ptr())


def test_a_tensor_copied_out_of_the_checkpoint_map_gives_its_pages_back(tmp_path):
    import mmap  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from vlserve.model import mapped  # noqa: PLC0415

    path = tmp_path / "model.safetensors"
    original = torch.randn(2048, 1024)  # 8 MiB
    save_file({"weight": original}, path)
    with safe_open(path, framework="pt") as checkpoint:
        weight = checkpoint.get_tensor("weight")  # a view of the file's private mapping
    assert torch.equal(weight, original)  # read: its pages are resident
    before = _resident_bytes_of(path)
    assert before >= weight.nbytes - mmap.PAGESIZE
    copy = weight.clone()
    released = mapped.release(weight)
    assert weight.nbytes - 2 * mmap.PAGESIZE <= released <= weight.nbytes
    assert _resident_bytes_of(path) <= before - released
    # Nothing is lost: the copy, and the view itself (its pages come back from the file).
    assert torch.equal(copy, original) and torch.equal(weight, original)
    # Anonymous memory is never handed back (MADV_DONTNEED would zero it).
    assert mapped.release(copy) == 0 and torch.equal(copy, original)
