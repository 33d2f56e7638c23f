"""The model lock: a checkpoint pinned by every file's sha256, and by its hub commit where it came from the hub.

`make_lock(directory)` writes what a checkpoint is; `verify(directory, lock)` says how a copy differs.
The lock lives in the inventory (`vlserve_deploy_model_lock`), so hosts deployed a week apart run the
same weights, and a file changed anywhere between the hub, the controller and a host is named.

The hub commit is taken only from evidence the download left, never guessed:
- `snapshot_download(local_dir=...)` writes `<dir>/.cache/huggingface/download/<file>.metadata`, whose
  first line is the commit the file came from (every file must name the same one);
- the hub's cache layout names it in the path: `.../models--<org>--<name>/snapshots/<commit>/`.
A checkpoint with neither (made locally, or copied without that metadata) is locked by its files
alone (`revision: null`): it can be copied from the controller, not fetched from the hub.

Standard library only: it runs on a bare controller and on hosts before any worker does.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_VERSION = 1
COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Not part of the checkpoint: the hub client's own bookkeeping, and the markers vlserve writes beside it.
SKIPPED_DIRS = (".cache",)
SKIPPED_PREFIX = ".vlserve"


class LockError(ValueError):
    """A lock that is not one, in one line."""


def checkpoint_files(directory: Path) -> list[str]:
    """Every file of the checkpoint, as a path relative to it, sorted."""
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if relative.parts[0] in SKIPPED_DIRS or relative.name.startswith(SKIPPED_PREFIX) or not path.is_file():
            continue
        found.append(relative.as_posix())
    return sorted(found)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def hub_origin(directory: Path) -> tuple[str | None, str | None]:
    """(repo, commit) the download left evidence of; None for what it did not."""
    metadata = sorted((directory / ".cache" / "huggingface" / "download").rglob("*.metadata"))
    commits = set()
    for path in metadata:
        lines = path.read_text(errors="replace").splitlines()
        commits.add(lines[0].strip() if lines else "")
    if len(commits) == 1 and COMMIT.match(next(iter(commits))):
        return None, next(iter(commits))
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and COMMIT.match(resolved.name):
        cached = resolved.parent.parent.name
        if cached.startswith("models--"):
            return cached[len("models--") :].replace("--", "/", 1), resolved.name
        return None, resolved.name
    return None, None


def make_lock(directory: Path, repo: str | None = None) -> dict[str, Any]:
    """The lock of a checkpoint directory: its hub origin where known, and each file's size and sha256."""
    if not (directory / "config.json").is_file():
        raise LockError("%s has no config.json: not a Hugging Face checkpoint" % directory)
    found_repo, commit = hub_origin(directory)
    files = {
        name: {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in checkpoint_files(directory)
    }
    return {"version": LOCK_VERSION, "repo": repo or found_repo, "revision": commit, "files": files}


def check_lock(lock: Any) -> dict[str, Any]:
    """The lock itself, or LockError saying what is wrong with it."""
    if not isinstance(lock, dict) or lock.get("version") != LOCK_VERSION:
        raise LockError("not a model lock of version %d (vlserve model lock writes one)" % LOCK_VERSION)
    if lock.get("revision") is not None and not COMMIT.match(str(lock["revision"])):
        raise LockError("revision must be a 40-hex hub commit or null, not %r" % lock["revision"])
    files = lock.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        raise LockError("files must map each file of the checkpoint (config.json among them) to its size and sha256")
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not SHA256.match(str(entry.get("sha256", "")))
            or not isinstance(entry.get("size"), int)
            or entry["size"] < 0
            or name.startswith("/")
            or ".." in Path(name).parts
        ):
            raise LockError("files.%s must be a relative path with a size and a 64-hex sha256" % name)
    return lock


@dataclass
class Verdict:
    """How a directory differs from a lock."""

    missing: list[str] = field(default_factory=list)
    mismatched: list[dict[str, Any]] = field(default_factory=list)  # name; size, sha256 found and locked
    extra: list[str] = field(default_factory=list)  # files the lock does not name (left alone)
    bytes_needed: int = 0  # what a copy must write: the locked size of every missing or mismatched file

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched

    def first_fault(self, where: str) -> str:
        """One line naming the first file that differs."""
        if self.mismatched:
            bad = self.mismatched[0]
            if bad["size"] != bad["locked_size"]:
                found = "size %d, the lock's %d" % (bad["size"], bad["locked_size"])
            else:
                found = "sha256 %s, the lock's %s" % (bad["sha256"], bad["locked_sha256"])
            return "%s/%s does not match the model lock (%s)" % (where, bad["name"], found)
        if self.missing:
            return "%s/%s is missing (the model lock names it)" % (where, self.missing[0])
        return "%s matches the model lock" % where

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "missing": self.missing,
            "mismatched": self.mismatched,
            "extra": self.extra,
            "bytes_needed": self.bytes_needed,
        }


def verify(directory: Path, lock: dict[str, Any], quick: bool = False) -> Verdict:
    """Every locked file of `directory` against the lock. `quick`: a file of the locked size counts as
    the same without hashing (a pre-copy estimate of what must be written, never the verdict itself)."""
    verdict = Verdict()
    present = set(checkpoint_files(directory)) if directory.is_dir() else set()
    for name, entry in sorted(check_lock(lock)["files"].items()):
        path = directory / name
        if name not in present:
            verdict.missing.append(name)
            verdict.bytes_needed += entry["size"]
            continue
        size = path.stat().st_size
        found = "unread" if quick or size != entry["size"] else sha256_file(path)
        if size == entry["size"] and found in ("unread", entry["sha256"]):
            continue
        verdict.mismatched.append(
            {
                "name": name,
                "size": size,
                "sha256": found,
                "locked_size": entry["size"],
                "locked_sha256": entry["sha256"],
            }
        )
        verdict.bytes_needed += entry["size"]
    verdict.extra = sorted(present - set(lock["files"]))
    return verdict


def digest(lock: dict[str, Any]) -> str:
    """One sha256 of a lock's content (the rollout's fingerprint counts it)."""
    return hashlib.sha256(json.dumps(lock, sort_keys=True).encode()).hexdigest()
