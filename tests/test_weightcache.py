"""The weight cache: a second start maps what the first rounded; a stale, foreign or broken file is rebuilt."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_tool, vm_flags_at
from vlserve.kernels import native, quantized
from vlserve.model import packing, weightcache
from vlserve.model.loader import load_model
from vlserve.model.weightcache import KEY_FIELD, WeightCache
from vlserve.settings import LimitSettings, ModelSettings

LIMITS = LimitSettings(max_batch_size=2, max_context_tokens=1024)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny-bf16"
    assert run_tool("vlserve", "make-test-model", str(directory)).returncode == 0
    return directory


@pytest.fixture
def roundings(monkeypatch):
    """How many weights were rounded (each weight is rounded through `_in_chunks` once)."""
    calls = []
    original = quantized._in_chunks

    def counting(matrix, quantize):
        calls.append(tuple(matrix.shape))
        return original(matrix, quantize)

    monkeypatch.setattr(quantized, "_in_chunks", counting)
    return calls


def load(checkpoint, cache, level):
    settings = ModelSettings(
        model=checkpoint, dtype="bfloat16", quantize=level, vision_dtype="int8", weight_cache=str(cache)
    )
    loaded = load_model(settings, LIMITS, status=lambda message: None)
    return loaded


def logits(loaded, finish_layouts=True):
    if finish_layouts:
        for step in loaded.layout_steps:
            step()
    with torch.inference_mode():
        return loaded.model(input_ids=torch.arange(40)[None]).logits


def cache_file(cache):
    files = list(cache.glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.parametrize("level", ["int8", "int4"])
def test_a_second_start_maps_what_the_first_rounded_and_answers_the_same(checkpoint, tmp_path, roundings, level):
    first = load(checkpoint, tmp_path, level)
    rounded_first = len(roundings)
    assert rounded_first > 0
    # Rounded weights are in their kernel's layout at once (tiles or torch's): nothing waits for ready.
    assert first.layout_steps == []
    path = cache_file(tmp_path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # the service's UMask=0077 too
    roundings.clear()
    second = load(checkpoint, tmp_path, level)
    assert roundings == []  # nothing rounded again: every weight came from the file
    assert len(second.layout_steps) == len(first.layout_steps)
    # Plain layouts first (what a worker answers with right after ready), then the kernels' layouts.
    assert torch.allclose(logits(first, False), logits(second, False), rtol=0, atol=1e-5)
    assert torch.equal(logits(first), logits(second))
    uncached = load_model(
        ModelSettings(model=checkpoint, dtype="bfloat16", quantize=level, vision_dtype="int8", weight_cache="off"),
        LIMITS,
        status=lambda message: None,
    )
    # Without a cache the int4 level's int8 prompt copies are made after ready; with one, at load.
    assert second.prefill_copies == [] and bool(uncached.prefill_copies) == (
        level == "int4" and first.choices.prefill_dtype == "int8"
    )
    uncached.settle()
    assert torch.equal(logits(uncached), logits(second))


def rewrite(path, change_key=None, change_tensors=None):
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name).clone() for name in file.keys()}  # noqa: SIM118
    key = json.loads(metadata[KEY_FIELD])
    if change_key:
        change_key(key)
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, str(path), metadata={KEY_FIELD: json.dumps(key)})


def touch_the_checkpoint(checkpoint, path):
    stat = (checkpoint / "config.json").stat()
    os.utime(checkpoint / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def from_another_torch(checkpoint, path):
    rewrite(path, change_key=lambda key: key.update(torch="2.0.0"))


def from_another_cpu(checkpoint, path):
    rewrite(path, change_key=lambda key: key.update(cpu_capability="NO AVX"))


def truncated(checkpoint, path):
    with path.open("r+b") as file:
        file.truncate(path.stat().st_size // 2)


def not_safetensors(checkpoint, path):
    path.write_bytes(b"\x00" * 64)


@pytest.mark.parametrize(
    "spoil", [touch_the_checkpoint, from_another_torch, from_another_cpu, truncated, not_safetensors]
)
def test_a_stale_foreign_or_broken_file_is_rebuilt_never_trusted(checkpoint, tmp_path, roundings, caplog, spoil):
    reference = logits(load(checkpoint, tmp_path, "int4"))
    rounded = len(roundings)
    path = cache_file(tmp_path)
    spoil(checkpoint, path)
    roundings.clear()
    with caplog.at_level(logging.INFO, logger="vlserve.model.weightcache"):
        rebuilt = load(checkpoint, tmp_path, "int4")
    assert len(roundings) == rounded  # every weight rounded again
    assert any(word in caplog.text for word in ("stale or foreign", "unreadable"))
    assert torch.equal(logits(rebuilt), reference)
    roundings.clear()
    load(checkpoint, tmp_path, "int4")
    assert roundings == []  # and the rebuilt file is used from then on


def test_a_layer_of_the_wrong_shape_is_rounded_again(checkpoint, tmp_path, roundings, caplog):
    reference = logits(load(checkpoint, tmp_path, "int8"))
    path = cache_file(tmp_path)

    def shrink(tensors):  # one output fewer, in whichever layout the head was rounded
        if "lm_head.tiles" in tensors:
            tensors["lm_head.outputs"] = tensors["lm_head.outputs"] - 1
        else:
            tensors["lm_head.values"] = tensors["lm_head.values"][:-1].contiguous()

    rewrite(path, change_tensors=shrink)
    roundings.clear()
    with caplog.at_level(logging.WARNING, logger="vlserve.model.weightcache"):
        again = load(checkpoint, tmp_path, "int8")
    assert len(roundings) == 1 and "lm_head" in caplog.text
    assert torch.equal(logits(again), reference)


def test_a_cache_that_cannot_be_written_costs_only_the_rounding(checkpoint, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="vlserve.model.weightcache"):
        loaded = load(checkpoint, blocked / "weights", "int8")
    assert "cannot write" in caplog.text
    assert logits(loaded).isfinite().all()


def test_the_key_names_what_the_tensors_depend_on(checkpoint):
    key = WeightCache(checkpoint.parent, checkpoint, "int4", native.STOCK_KERNELS).key
    assert key["level"] == "int4" and key["torch"] == torch.__version__
    assert key["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    names = {entry["name"] for entry in key["model"]}
    assert "config.json" in names and any(name.endswith(".safetensors") for name in names)
    assert all("header_sha256" in entry for entry in key["model"] if entry["name"].endswith(".safetensors"))


def test_settle_leaves_nothing_for_after_ready(checkpoint, tmp_path):
    """What benchmarks time: kernel layouts made, prompt copies made."""
    settings = ModelSettings(
        model=checkpoint, dtype="bfloat16", quantize="int4", prefill_dtype="int8", weight_cache="off"
    )
    loaded = load_model(settings, LIMITS, status=lambda message: None)  # no cache: int8 prompt copies after ready
    assert bool(loaded.prefill_copies) == quantized.int8_products_supported(loaded.kernels)
    loaded.settle()
    assert (loaded.layout_steps, loaded.prefill_copies) == ([], [])
    assert packing.layout_steps(loaded.model) == [] and packing.pending_prefill_copies(loaded.model) == []
    # The output head is an int8 copy: the embedding, looked up a row at a time in the checkpoint's map,
    # is advised so (vlserve.model.mapped.read_by_rows).
    embedding = loaded.model.model.language_model.embed_tokens.weight
    assert "rr" in vm_flags_at(embedding.data_ptr() + embedding.nbytes // 2)


def test_int8_prompt_copies_are_mapped_from_the_cache_not_made_after_ready(checkpoint, tmp_path, roundings, caplog):
    """The int4 level's prompt copies are Q8_0 weights like any other: rounded into the cache file on the
    first start, mapped by the next, and nothing is left for after ready either time."""
    settings = ModelSettings(
        model=checkpoint, dtype="bfloat16", quantize="int4", prefill_dtype="int8", weight_cache=str(tmp_path)
    )
    first = load_model(settings, LIMITS, status=lambda message: None)
    if first.choices.prefill_dtype != "int8":
        pytest.skip("vlserve's int8 product is not loaded here: %s" % first.kernels.status)
    copies = [m for m in first.model.modules() if getattr(m, "prefill_weight", None) is not None]
    assert copies and first.prefill_copies == []
    with safe_open(str(cache_file(tmp_path)), framework="pt") as file:
        prompt_layers = {name.rsplit(".", 1)[0] for name in file.keys() if ".prompt." in name}  # noqa: SIM118
    assert len(prompt_layers) == len(copies)
    roundings.clear()
    with caplog.at_level(logging.INFO, logger="vlserve.model.loader"):
        second = load_model(settings, LIMITS, status=lambda message: None)
    assert roundings == [] and second.prefill_copies == []
    assert "mapped %d int8 prompt copies" % len(copies) in caplog.text
    assert torch.equal(logits(first), logits(second))


def test_tensors_are_written_at_aligned_offsets_and_read_back_by_safetensors(tmp_path):
    """Odd sizes between them: fillers keep every tensor on a 64-byte boundary of the file and of its map."""
    tensors = {
        "a.flags": torch.tensor([True, False, True]),
        "a.scales": torch.arange(5, dtype=torch.float32),
        "b.values": torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4),
        "b.halves": torch.randn(2, 3).to(torch.bfloat16),
        "c.empty": torch.zeros(0, dtype=torch.float32),
    }
    path = tmp_path / "aligned.safetensors"
    weightcache.write_aligned(path, tensors, {"note": "x"})
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"note": "x"}
        names = [name for name in file.keys() if not name.startswith(weightcache.PADDING)]  # noqa: SIM118
        assert sorted(names) == sorted(tensors)
        for name in names:
            mapped = file.get_tensor(name)
            assert torch.equal(mapped, tensors[name]) and mapped.dtype == tensors[name].dtype
            if mapped.numel():
                assert mapped.data_ptr() % weightcache.ALIGNMENT == 0, name


def test_cached_weights_are_mapped_at_aligned_addresses(checkpoint, tmp_path):
    loaded = load(checkpoint, tmp_path, "int4")
    prepared = WeightCache(tmp_path, checkpoint, "int4", loaded.kernels).open()
    assert prepared.found
    for layer in prepared.found.values():
        for tensor in layer.values():
            assert tensor.data_ptr() % weightcache.ALIGNMENT == 0


def test_the_key_names_the_code_that_wrote_the_file(monkeypatch, tmp_path):
    """A release that changes how weights are rounded or laid out rounds them again: no number to bump."""
    package = pathlib.Path(weightcache.__file__).resolve().parents[1]
    for name in weightcache.WRITERS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((package / name).read_bytes())
    monkeypatch.setattr(weightcache, "__file__", str(tmp_path / "model" / "weightcache.py"))
    weightcache.code_digest.cache_clear()
    before = weightcache.code_digest()
    (tmp_path / "kernels" / "formats.py").write_text("# another layout\n")
    weightcache.code_digest.cache_clear()
    assert weightcache.code_digest() != before
    weightcache.code_digest.cache_clear()


def test_workers_starting_together_on_a_cold_cache_round_once(checkpoint, tmp_path):
    """Two processes load one level into one empty cache at once: one rounds and writes, the other
    waits for its file (or finds it) and maps it."""
    script = (
        "import logging, pathlib, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from vlserve.model.loader import load_model\n"
        "from vlserve.settings import LimitSettings, ModelSettings\n"
        "settings = ModelSettings(model=sys.argv[1], dtype='bfloat16', quantize='int8', weight_cache=sys.argv[2])\n"
        "load_model(settings, LimitSettings(), status=lambda message: None)\n"
    )
    cache = tmp_path / "cache"
    runs = [
        subprocess.Popen([sys.executable, "-c", script, str(checkpoint), str(cache)], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [run.communicate(timeout=600)[1] for run in runs]
    assert all(run.returncode == 0 for run in runs), logs
    wrote = [log for log in logs if "weight cache: wrote" in log]
    assert len(wrote) == 1, logs
    (other,) = [log for log in logs if log not in wrote]
    assert "weight cache: mapping" in other and "weight cache: wrote" not in other
    assert [p.name for p in cache.glob("*.safetensors")] and not list(cache.glob("*.partial"))
