"""The model lock: what `vlserve model lock` pins, and how `vlserve model verify` names a file that differs."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from conftest import run_tool
from vlserve.ops import modellock

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def checkpoint(tiny_model, tmp_path):
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    return copy


def test_a_local_checkpoint_is_locked_by_its_files_alone(checkpoint):
    lock = modellock.make_lock(checkpoint)
    assert lock["revision"] is None and lock["repo"] is None  # nothing says where it came from: no guess
    assert set(lock["files"]) == {p.name for p in checkpoint.iterdir()}
    entry = lock["files"]["config.json"]
    assert entry["size"] == (checkpoint / "config.json").stat().st_size
    assert entry["sha256"] == modellock.sha256_file(checkpoint / "config.json")
    assert modellock.verify(checkpoint, lock).ok


def test_the_hub_commit_comes_from_what_the_download_left(checkpoint, tmp_path):
    metadata = checkpoint / ".cache" / "huggingface" / "download"
    metadata.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (metadata / (name + ".metadata")).write_text('%s\n"etag"\n1767225600.0\n' % COMMIT)
    lock = modellock.make_lock(checkpoint, repo="Qwen/Qwen3-VL-2B-Instruct")
    assert (lock["repo"], lock["revision"]) == ("Qwen/Qwen3-VL-2B-Instruct", COMMIT)
    assert not any(name.startswith(".cache") for name in lock["files"])  # the client's bookkeeping is not the model
    (metadata / "config.json.metadata").write_text("f" * 40 + "\n")  # files from two commits: no one commit
    assert modellock.make_lock(checkpoint)["revision"] is None
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-VL-2B-Instruct" / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot, ignore=shutil.ignore_patterns(".cache"))
    assert modellock.hub_origin(snapshot) == ("Qwen/Qwen3-VL-2B-Instruct", COMMIT)


def test_one_changed_byte_names_its_file(checkpoint):
    lock = modellock.make_lock(checkpoint)
    weights = next(checkpoint.glob("*.safetensors"))
    body = bytearray(weights.read_bytes())
    body[-1] ^= 1
    weights.write_bytes(bytes(body))
    (checkpoint / "notes.txt").write_text("not the model's\n")
    verdict = modellock.verify(checkpoint, lock)
    assert not verdict.ok and [m["name"] for m in verdict.mismatched] == [weights.name]
    assert verdict.extra == ["notes.txt"] and verdict.bytes_needed == len(body)
    assert verdict.first_fault("/m").startswith("/m/%s does not match the model lock (sha256 " % weights.name)
    # sizes alone cannot see it: --quick only estimates what a copy would write
    assert modellock.verify(checkpoint, lock, quick=True).ok
    body[-1] ^= 1
    weights.write_bytes(bytes(body))
    (checkpoint / "config.json").unlink()
    missing = modellock.verify(checkpoint, lock)
    assert (
        missing.missing == ["config.json"]
        and missing.first_fault("/m") == "/m/config.json is missing (the model lock names it)"
    )


@pytest.mark.parametrize(
    ("lock", "says"),
    [
        ({"version": 2, "files": {}}, "not a model lock of version 1"),
        (
            {"version": 1, "revision": "main", "files": {"config.json": {"size": 1, "sha256": "0" * 64}}},
            "40-hex hub commit",
        ),
        ({"version": 1, "files": {"a.bin": {"size": 1, "sha256": "0" * 64}}}, "config.json among them"),
        ({"version": 1, "files": {"config.json": {"size": 1, "sha256": "xyz"}}}, "files.config.json must be"),
        (
            {
                "version": 1,
                "files": {"config.json": {"size": 1, "sha256": "0" * 64}, "../x": {"size": 1, "sha256": "0" * 64}},
            },
            "files.../x must be",
        ),
    ],
)
def test_a_malformed_lock_is_refused_in_one_line(lock, says):
    with pytest.raises(modellock.LockError, match=says.replace(".", r"\.").replace("(", r"\(")):
        modellock.check_lock(lock)


def test_the_commands_write_a_lock_for_the_inventory_and_check_a_copy_against_it(checkpoint, tmp_path):
    written = tmp_path / "lock.yml"
    result = run_tool("vlserve", "model", "lock", str(checkpoint), "--output", str(written))
    assert result.returncode == 0, result.stderr
    assert "no hub commit found" in result.stderr
    lock = yaml.safe_load(written.read_text())["vlserve_deploy_model_lock"]  # as the inventory holds it
    assert lock == modellock.make_lock(checkpoint)
    ok = run_tool("vlserve", "model", "verify", str(checkpoint), "--lock", str(written))
    assert ok.returncode == 0 and "matches the model lock" in ok.stdout
    (checkpoint / "config.json").write_text("{}")
    bad = run_tool("vlserve", "model", "verify", str(checkpoint), "--lock", str(written))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "config.json does not match" in bad.stderr
    verdict = run_tool("vlserve", "model", "verify", str(checkpoint), "--lock", str(written), "--json")
    assert verdict.returncode == 0 and json.loads(verdict.stdout)["mismatched"][0]["name"] == "config.json"
    written.write_text("files: [")
    broken = run_tool("vlserve", "model", "verify", str(checkpoint), "--lock", str(written))
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1 and "cannot read the lock" in broken.stderr
    assert run_tool("vlserve", "model", "lock", str(tmp_path)).returncode == 2  # no config.json: not a checkpoint
