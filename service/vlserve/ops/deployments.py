"""The deployments a host ran that passed their health gate: what a failed rollout puts back, and
what `playbooks/rollback.yml` goes back to.

A deployment is what the workers and the host front run with: the release (where the install's
`current` link points), the rendered files (the units, the shared settings, each worker's share of
the plan and its drop-in, the front's configuration and error pages, the plan itself) and the
fingerprint the rollout compares. Not kept: secrets (the front's certificate and the clients' key
digests: going back never brings back a rotated key or an old certificate) and the model's files (a
checkpoint is gigabytes; the model lock's check stops a host whose model no longer matches).

On the host: DEPLOYMENTS_DIR/<id>/files/<the file's absolute path> and <id>/meta.json, and
history.json, the ids oldest first, the last one what the host runs. `restore(last_good)` puts back
what the host ran before a failed rollout (the failed deployment was never saved). `go_back(release)`
leaves a release: a host that runs it gets the newest deployment of an earlier release back (the
newer ones are dropped); a host that does not run it is left alone, so running it again changes
nothing.

It runs on hosts, from the installed release (`vlserve deployment`).
"""

from __future__ import annotations

import filecmp
import glob
import json
import os
import shutil
import time
from typing import Any

from vlserve.ops import units

DEPLOYMENTS_DIR = "/var/lib/vlserve/deployments"
KEPT = 3  # as many as the releases a host keeps (vlserve_deploy_releases_kept's default)
CURRENT_LINK = "/opt/vlserve/current"  # the install's (vlserve_deploy_install_dir's default)
FINGERPRINT_FILE = units.CONFIG_DIR + "/deployed"  # the fingerprint the rollout compares


def deployment_files(plan: dict[str, Any]) -> list[str]:
    """What a deployment of this plan is made of on the host: the units, the shared settings, each of
    the plan's workers' settings and drop-in, the front's configuration, the plan."""
    files = [*units.UNIT_FILES.values(), units.CONFIG_FILES["vlserve.env.j2"], units.CONFIG_FILES["haproxy.cfg.j2"]]
    for worker in plan["worker_list"]:
        files += [path.format(index=worker["index"]) for path in units.WORKER_FILES.values()]
    return [*files, units.PLAN_FILE]


def managed_files() -> list[str]:
    """Patterns of files a deployment may have and another not (its workers'): a restore removes
    those the deployment it puts back did not have."""
    return [path.format(index="*") for path in units.WORKER_FILES.values()]


class DeploymentError(Exception):
    """Nothing to go back to, or a kept deployment that cannot be put back (its release is gone)."""


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


def _read_json(path: str, default: Any) -> Any:
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return default


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".new", "w") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(path + ".new", path)


def _copy(source: str, target: str) -> bool:
    """A file with its mode and owner; False when the target already holds the same bytes and mode."""
    same = os.path.exists(target) and filecmp.cmp(source, target, shallow=False)
    if same and os.stat(source).st_mode == os.stat(target).st_mode:
        return False
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(source, target + ".new")
    info = os.stat(source)
    os.chown(target + ".new", info.st_uid, info.st_gid)
    os.replace(target + ".new", target)
    return True


class Deployments:
    """The deployments kept on one host. `root` prefixes every path (tests run on a tree)."""

    def __init__(self, directory: str = DEPLOYMENTS_DIR, root: str = ""):
        self.root = root
        self.directory = _under(root, directory)
        self.history_file = os.path.join(self.directory, "history.json")

    def history(self) -> list[str]:
        return _read_json(self.history_file, [])

    def meta(self, deployment: str) -> dict[str, Any]:
        meta = _read_json(os.path.join(self.directory, deployment, "meta.json"), None)
        if meta is None:
            raise DeploymentError("the deployment %s is not kept on this host" % deployment)
        return meta

    def releases(self) -> list[str]:
        """The releases the kept deployments run: the install may not remove them."""
        return sorted({self.meta(deployment)["release"] for deployment in self.history()})

    def save(self, fingerprint: str, release: str, files: list[str], keep: int = KEPT) -> dict[str, Any]:
        """Keep what the host runs now, after its health gate passed; the oldest beyond `keep` go."""
        deployment = fingerprint[:16]
        stored = os.path.join(self.directory, deployment)
        present = sorted(path for path in set(files) if os.path.isfile(_under(self.root, path)))
        changed = False
        for path in present:
            changed |= _copy(_under(self.root, path), os.path.join(stored, "files", path.lstrip("/")))
        meta = {"fingerprint": fingerprint, "release": release, "files": present}
        if _read_json(os.path.join(stored, "meta.json"), {}).get("files") != present or changed:
            changed = True
            _write_json(os.path.join(stored, "meta.json"), dict(meta, saved_at=int(time.time())))
        history = self.history()
        if history[-1:] != [deployment]:
            changed = True
            history = [kept for kept in history if kept != deployment] + [deployment]
            for dropped in history[:-keep]:
                shutil.rmtree(os.path.join(self.directory, dropped), ignore_errors=True)
            _write_json(self.history_file, history[-keep:])
        return {"changed": changed, "deployment": deployment, "release": release}

    def restore(self, deployment: str, managed: list[str], current_link: str, fingerprint_file: str) -> dict[str, Any]:
        """Put a kept deployment back: its files (and none of the `managed` patterns' files it did not
        have: the workers a failed plan added), the `current` link to its release, its fingerprint."""
        meta = self.meta(deployment)
        stored = os.path.join(self.directory, deployment, "files")
        link = _under(self.root, current_link)
        release_dir = os.path.join(os.path.dirname(link), "releases", meta["release"])
        if not os.path.isdir(release_dir):
            raise DeploymentError(
                "the release %s of deployment %s is no longer on this host" % (meta["release"], deployment)
            )
        changed = [
            path for path in meta["files"] if _copy(os.path.join(stored, path.lstrip("/")), _under(self.root, path))
        ]
        for pattern in managed:
            for found in sorted(glob.glob(_under(self.root, pattern))):
                path = "/" + os.path.relpath(found, self.root or "/")
                if path not in meta["files"]:
                    os.unlink(found)
                    changed.append(path)
                    folder = os.path.dirname(found)
                    if folder.endswith(".d") and not os.listdir(folder):  # a worker's drop-in directory
                        os.rmdir(folder)
        target = os.path.join("releases", meta["release"])
        if not os.path.islink(link) or os.readlink(link) != target:
            os.symlink(target, link + ".new")
            os.replace(link + ".new", link)
            changed.append(current_link)
        fingerprint_path = _under(self.root, fingerprint_file)
        with open(fingerprint_path, "a+") as handle:
            handle.seek(0)
            if handle.read().strip() != meta["fingerprint"]:
                handle.seek(0)
                handle.truncate()
                handle.write(meta["fingerprint"] + "\n")
                changed.append(fingerprint_file)
        return {"changed": bool(changed), "deployment": deployment, "release": meta["release"], "files": changed}

    def last_good(self) -> str:
        history = self.history()
        if not history:
            raise DeploymentError("no deployment of this host has passed its health gate yet: nothing to go back to")
        return history[-1]

    def go_back(self, release: str, managed: list[str], current_link: str, fingerprint_file: str) -> dict[str, Any]:
        """Leave `release`: put back the newest kept deployment of another release, and drop the newer
        ones (they ran the release left). A host that does not run it (never reached by its rollout,
        or already back) is left as it is: running this again changes nothing."""
        history = self.history()
        if not history:
            raise DeploymentError("no deployment of this host has passed its health gate yet: nothing to go back to")
        if self.meta(history[-1])["release"] != release:
            return {
                "changed": False,
                "deployment": history[-1],
                "release": self.meta(history[-1])["release"],
                "files": [],
            }
        earlier = [deployment for deployment in history if self.meta(deployment)["release"] != release]
        if not earlier:
            raise DeploymentError(
                "this host keeps no deployment of a release before %s: nothing to go back to" % release
            )
        result = self.restore(earlier[-1], managed, current_link, fingerprint_file)
        left = history[history.index(earlier[-1]) + 1 :]
        for dropped in left:
            shutil.rmtree(os.path.join(self.directory, dropped), ignore_errors=True)
        _write_json(self.history_file, history[: history.index(earlier[-1]) + 1])
        return dict(result, changed=True, left=left)
