"""The deployments a host keeps (`vlserve deployment`), on trees that `vlserve render-units` writes as
the deploy role would: what passed its gate is saved, a failed rollout's host gets the last good one
back, and leaving a release is done once however often it is asked."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from conftest import REPO, run_tool
from vlserve.ops import units

FACTS = REPO / "tests" / "fixtures" / "topologies" / "xeon-avx512bf16-2vcpu-vm.json"


def deploy(root: pathlib.Path, release: str, workers: int, max_pixels: int) -> str:
    """What the role writes for a plan of `workers` workers, its release installed; returns the
    fingerprint (here: the settings)."""
    (root / "opt/vlserve/releases" / release).mkdir(parents=True, exist_ok=True)
    rendered = run_tool(
        "vlserve", "render-units", "--out", str(root), "--facts", str(FACTS), "--max-workers", str(workers),
        "--front-bind", "127.0.0.1", "--insecure", "--min-threads-per-worker", "1",
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    env = root / units.CONFIG_FILES["vlserve.env.j2"].lstrip("/")
    env.write_text(env.read_text() + "VLSERVE_MAX_PIXELS=%d\n" % max_pixels)
    return hashlib.sha256(b"%d workers, %d pixels, %s" % (workers, max_pixels, release.encode())).hexdigest()


def deployment(root: pathlib.Path, *args: str) -> dict:
    result = run_tool("vlserve", "deployment", *args, "--root", str(root), "--dir", "/var/lib/vlserve/deployments")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def state(root: pathlib.Path) -> dict:
    return {
        "current": (root / "opt/vlserve/current").readlink().name
        if (root / "opt/vlserve/current").is_symlink()
        else None,
        "env": (root / "etc/vlserve/vlserve.env").read_text(),
        "workers": sorted(p.name for p in (root / "etc/vlserve").glob("worker-*.env")),
        "drop-ins": sorted(p.name for p in (root / "etc/systemd/system").glob("vlserve@*.service.d")),
        "fingerprint": (root / "etc/vlserve/deployed").read_text().strip(),
    }


def activate(root: pathlib.Path, release: str, fingerprint: str) -> None:
    link = root / "opt/vlserve/current"
    link.unlink(missing_ok=True)
    link.symlink_to("releases/" + release)
    (root / "etc/vlserve/deployed").write_text(fingerprint + "\n")


def test_a_failed_rollout_gets_the_last_good_deployment_back_and_leaving_a_release_is_done_once(tmp_path):
    root = tmp_path / "host"
    first = deploy(root, "1.0-aaa", workers=1, max_pixels=40000)
    activate(root, "1.0-aaa", first)
    assert deployment(root, "save", "--fingerprint", first, "--release", "1.0-aaa")["changed"]
    assert not deployment(root, "save", "--fingerprint", first, "--release", "1.0-aaa")["changed"]
    good = state(root)

    second = deploy(root, "1.1-bbb", workers=2, max_pixels=50000)
    activate(root, "1.1-bbb", second)
    assert deployment(root, "save", "--fingerprint", second, "--release", "1.1-bbb")["changed"]
    second_state = state(root)
    assert second_state["workers"] == ["worker-0.env", "worker-1.env"]

    # A third deployment fails its gate (never saved): the last good one comes back, files and release.
    broken = deploy(root, "1.2-ccc", workers=1, max_pixels=60000)
    activate(root, "1.2-ccc", broken)
    (root / "etc/vlserve/worker-1.env").unlink()
    restored = deployment(root, "restore")
    assert (
        restored["changed"] and restored["release"] == "1.1-bbb" and [w["index"] for w in restored["workers"]] == [0, 1]
    )
    assert state(root) == second_state
    assert not deployment(root, "restore")["changed"]  # again: nothing to do

    # Leaving release 1.1: the first deployment, its single worker (the second's files and drop-in
    # go), its release; asked again, or of a host that does not run 1.1, nothing changes.
    back = deployment(root, "restore", "--leaving", "1.1-bbb")
    assert back["changed"] and back["release"] == "1.0-aaa" and back["left"] == [second[:16]]
    assert state(root) == good
    again = deployment(root, "restore", "--leaving", "1.1-bbb")
    assert not again["changed"] and again["release"] == "1.0-aaa" and state(root) == good
    listed = deployment(root, "list")
    assert [d["release"] for d in listed["deployments"]] == ["1.0-aaa"] and listed["releases"] == ["1.0-aaa"]


def test_leaving_a_release_goes_past_all_its_deployments_and_only_the_newest_are_kept(tmp_path):
    root = tmp_path / "host"
    for number, release in enumerate(["1.0-x", "1.1-x", "1.2-x", "1.2-x"]):  # 1.2 twice: a settings change
        fingerprint = deploy(root, release, workers=1, max_pixels=40000 + number)
        activate(root, release, fingerprint)
        deployment(root, "save", "--fingerprint", fingerprint, "--release", release, "--keep", "3")
    assert [d["release"] for d in deployment(root, "list")["deployments"]] == ["1.1-x", "1.2-x", "1.2-x"]
    assert deployment(root, "restore", "--leaving", "1.2-x")["release"] == "1.1-x"
    assert [d["release"] for d in deployment(root, "list")["deployments"]] == ["1.1-x"]
    result = run_tool("vlserve", "deployment", "restore", "--leaving", "1.1-x", "--root", str(root))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "keeps no deployment of a release before 1.1-x" in result.stderr


def test_a_deployment_whose_release_is_gone_is_refused_in_one_line(tmp_path):
    root = tmp_path / "host"
    first = deploy(root, "1.0-a", workers=1, max_pixels=40000)
    activate(root, "1.0-a", first)
    deployment(root, "save", "--fingerprint", first, "--release", "1.0-a")
    (root / "opt/vlserve/releases/1.0-a").rmdir()
    result = run_tool("vlserve", "deployment", "restore", "--root", str(root))
    assert result.returncode == 2 and "the release 1.0-a of deployment" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["restore"], ["restore", "--leaving", "1.0-a"]])
def test_a_host_with_nothing_kept_says_so(tmp_path, command):
    result = run_tool("vlserve", "deployment", *command, "--root", str(tmp_path))
    assert result.returncode == 2 and "nothing to go back to" in result.stderr
