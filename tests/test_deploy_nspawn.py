"""The deployment on a real systemd host (systemd-nspawn): site.yml end to end with the tiny model.

torch's CPU wheel is copied from this machine (the air-gapped path); the tiny model comes from
the controller. Two workers (the cores split between them: one thread each on a 2-CPU machine)
behind the HAProxy front; every expectation about workers and threads is read from the plan.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import ssl
import subprocess
import time
import zipfile

import httpx
import pytest

from conftest import free_port
from harness import nspawn
from harness.playbooks import audit, play, recap
from harness.releases import build_release
from harness.traffic import Traffic
from sample_images import image_question, png_bytes
from vlserve.kernels import native
from vlserve.ops import modellock

REASON = nspawn.available()
if REASON and os.environ.get("CI"):
    raise RuntimeError("the systemd tier must run in CI: %s" % REASON)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


# What the play made on the controller next to the inventory (the private CA, the default client's
# key): where every request of these tests gets its trust and its key.
CREDENTIALS: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deploy")
    CREDENTIALS["dir"] = directory / "vlserve-credentials"
    return directory


@pytest.fixture(scope="module")
def host_vars(tiny_model, torch_wheel):
    return {
        "vlserve_deploy_model_source": "controller",
        "vlserve_deploy_model_controller_dir": str(tiny_model),
        "vlserve_deploy_model_lock": modellock.make_lock(tiny_model),  # pinned, as a careful operator deploys
        "vlserve_deploy_torch_source": "wheels",
        "vlserve_deploy_wheels": [torch_wheel],
        "vlserve_deploy_front_port": free_port(),
        "vlserve_facts_base_port": free_port(),
        "vlserve_facts_min_threads_per_worker": 1,  # two workers on any host of two cores or more
        "vlserve_facts_max_workers": 2,
        "vlserve_deploy_releases_kept": 2,
    }


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    """Two more releases of this checkout, as two later commits would make them."""
    return {name: build_release(tmp_path_factory.mktemp(name), marker=name) for name in ("second", "third")}


def release_name(release: dict) -> str:
    return "%s-%s" % (release["version"], release["sha256"][:12])


def int8_vars(host_vars, releases) -> dict:
    """The second release at int8, as an 8 GB laptop's plan would quantize."""
    return dict(
        host_vars,
        vlserve_facts_quantize="int8",
        vlserve_deploy_settings={"max_pixels": 40000},
        vlserve_deploy_release_wheel=releases["second"]["path"],
    )


@pytest.fixture(scope="module")
def guest():
    with nspawn.NspawnHost() as host:
        yield host


@pytest.fixture(scope="module")
def deployed(guest, workdir, host_vars):
    result = play(guest, workdir, "site.yml", **host_vars)
    assert result.returncode == 0, result.stdout[-6000:]
    return result


def front(host_vars) -> str:
    return "https://127.0.0.1:%d" % host_vars["vlserve_deploy_front_port"]


def trust() -> ssl.SSLContext:
    """The private CA the play made, as a client trusts it."""
    return ssl.create_default_context(cafile=str(CREDENTIALS["dir"] / "ca.crt"))


def default_key() -> dict:
    return {"Authorization": "Bearer " + (CREDENTIALS["dir"] / "default-api-key").read_text().strip()}


def get(host_vars, path, key=True, **kwargs):
    headers = dict(default_key() if key else {}, **kwargs.pop("headers", {}))
    return httpx.get(
        front(host_vars) + path, headers=headers, verify=trust(), timeout=kwargs.pop("timeout", 10), **kwargs
    )


def ask(host_vars, timeout=60, **headers):
    return httpx.post(
        front(host_vars) + "/v1/chat/completions",
        json=image_question(png_bytes(), max_tokens=4),
        headers=default_key() | headers,
        verify=trust(),
        timeout=timeout,
    )


def test_check_mode_on_a_host_never_tuned_changes_nothing(guest, workdir, host_vars):
    """What an operator runs first: the audit, then site.yml --check, on a host that has never seen
    the toolkit. Both pass, say what they would do, and leave the host as it was (no file under
    /etc or /opt, so no unit, no user)."""
    before = guest.tree_digest("/etc", "/opt")
    audit(guest, workdir, **host_vars)
    result = play(guest, workdir, "site.yml", check=True, **host_vars)
    assert result.returncode == 0, result.stdout[-6000:]
    assert recap(result)["changed"] > 0  # it says what it would do
    assert "would enable and start" in result.stdout
    assert guest.tree_digest("/etc", "/opt") == before


def test_the_front_answers_a_question_about_an_image_and_the_journal_finds_it_by_its_id(guest, deployed, host_vars):
    response = ask(host_vars, **{"X-Request-Id": "deploy-tier-0001"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert "Ask the front a real question about an image" in deployed.stdout
    # The worker's record, by the ID the client sent, in structured journal fields; and the front's line.
    assert response.headers["x-request-id"] == "deploy-tier-0001"
    found = guest.ssh("journalctl -u 'vlserve@*' REQUEST_ID=deploy-tier-0001 -o json --no-pager").stdout
    records = [json.loads(line) for line in found.splitlines() if line.strip()]
    assert len(records) == 1, found
    record = records[0]
    assert record["REQUEST_STATUS"] == "200" and record["REQUEST_CLIENT"] == "default", record
    assert int(record["REQUEST_TTFT_MS"]) >= 0 and int(record["REQUEST_COMPLETION_TOKENS"]) >= 1, record
    assert record["_SYSTEMD_UNIT"].startswith("vlserve@") and record["SYSLOG_IDENTIFIER"] == "vlserve"
    assert "deploy-tier-0001" in guest.ssh("journalctl -u vlserve-front --no-pager -o cat -g deploy-tier-0001").stdout


def test_the_workers_follow_the_plan(guest, workdir, deployed, host_vars):
    report = audit(guest, workdir, **host_vars)
    plan = report["plan"]
    # The audit sees the front serve over TLS, and its certificate's end, months away.
    assert report["serving"] == "ready", report["serving"]
    certificate = next(row for row in report["knobs"] if row["knob"] == "certificate")
    assert certificate["current"]["file"] == "/etc/vlserve/tls/front.pem" and certificate["status"] == "ok", certificate
    assert len(plan["worker_list"]) == 2, "the rolling-restart tests need two workers: " + plan["workers"]["why"]
    assert guest.ssh("systemctl is-active vlserve.target").stdout.strip() == "active"
    running = guest.ssh("systemctl list-units --state=running --no-legend 'vlserve@*.service'").stdout
    assert len(running.strip().splitlines()) == len(plan["worker_list"])
    for worker in plan["worker_list"]:
        pid = guest.ssh("systemctl show -p MainPID --value vlserve@%d.service" % worker["index"]).stdout.strip()
        status = guest.ssh("cat /proc/%s/status" % pid).stdout
        allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)
        assert allowed == ",".join(str(c) for c in sorted(worker["cpus"] + worker["sibling_cpus"]))
        environ = dict(
            line.split("=", 1)
            for line in guest.ssh("tr '\\0' '\\n' < /proc/%s/environ" % pid).stdout.splitlines()
            if "=" in line
        )
        assert environ["OMP_NUM_THREADS"] == str(worker["threads"]) == str(len(worker["cpus"]))
        assert environ["OMP_PLACES"] == worker["environment"]["OMP_PLACES"]
        assert environ["VLSERVE_PORT"] == str(worker["port"])
        assert guest.ssh("ps -o user= -p %s" % pid).stdout.strip() == "vlserve"
        # The role installed g++ and the first worker built vlserve's kernels inside its hardened unit:
        # the exact level decodes through the bfloat16 product on CPUs with AVX-512 BF16 (this one's).
        kernels = httpx.get("http://127.0.0.1:%d/readyz" % worker["port"], timeout=10).json()["kernels"]
        bf16_kernel = native.cpu_tier()[0] == "avx512_vnni" and native.BF16_FLAG in native._cpu_flags()
        if plan["model"]["packed_weights"] and bf16_kernel:
            assert (
                kernels.startswith("vlserve's kernels for AVX-512 VNNI (bf16/")
                and "/var/cache/vlserve/kernels/" in kernels
            )


def test_the_page_and_the_status_through_the_front_show_the_plan_and_which_worker_answered(deployed, host_vars):
    """The deploy writes the plan where the workers' status page reads it (the hardened unit can)."""
    page = get(host_vars, "/", key=False)
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    names = set()
    for _ in range(6):
        response = get(host_vars, "/status", key=False)
        status = response.json()
        assert status["plan"]["source"] == "/etc/vlserve/plan.json"
        assert status["plan"]["workers"] == 2
        assert response.headers["x-vlserve-worker"] == status["worker"]["name"]
        names.add(status["worker"]["name"])
    assert len(names) == 2  # the front spreads them: the page says which worker answered


def main_pids(guest, plan) -> dict[int, str]:
    show = "systemctl show -p MainPID --value vlserve@%d.service"
    return {worker["index"]: guest.ssh(show % worker["index"]).stdout.strip() for worker in plan["worker_list"]}


def headroom(report) -> dict:
    return next(row for row in report["knobs"] if row["knob"] == "memory_headroom")


def test_a_second_run_changes_nothing_even_with_a_neighbour_taking_memory(guest, workdir, deployed, host_vars):
    """The plan is sized from capacity: a second run changes nothing and restarts no worker, even with
    another process grown since the first; the audit reports the pressure instead."""
    report = audit(guest, workdir, **host_vars)
    pids = main_pids(guest, report["plan"])
    try:
        # The host's other processes (the rest of the suite, in CI) move too: where they freed more than
        # the neighbour took between the two audits, size the neighbour again from a fresh one.
        for _ in range(3):
            row = headroom(audit(guest, workdir, **host_vars))
            hog = start_neighbour(guest, row)
            pressed = headroom(audit(guest, workdir, **host_vars))
            grown = pressed["current"]["other_processes_bytes"] - row["current"]["other_processes_bytes"]
            if pressed["status"] == "drift" and grown >= hog * 0.8:
                break
            guest.ssh("systemctl stop vlserve-test-neighbour", check=False)
        assert pressed["status"] == "drift", pressed
        assert "throttled or OOM-killed" in pressed["why"]
        assert grown >= hog * 0.8, (grown, hog)
        result = play(guest, workdir, "site.yml", **host_vars)
        assert result.returncode == 0, result.stdout[-4000:]
        assert recap(result)["changed"] == 0, result.stdout[-6000:]
        assert main_pids(guest, report["plan"]) == pids
    finally:
        guest.ssh("systemctl stop vlserve-test-neighbour", check=False)


def start_neighbour(guest, row: dict) -> int:
    """A process that leaves the workers 1 GiB less than the plan gives them, whatever the machine's
    size, once it holds its memory; returns its bytes."""
    hog = row["current"]["free_for_workers_bytes"] - row["desired"]["workers_bytes"] + 2**30
    assert 0 < hog < row["current"]["free_for_workers_bytes"]
    guest.ssh(
        "systemd-run --unit=vlserve-test-neighbour python3 -c \"import time; b = b'\\x01' * %d; time.sleep(900)\"" % hog
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the neighbour holds its memory
        pid = guest.ssh("systemctl show -p MainPID --value vlserve-test-neighbour").stdout.strip()
        held_kib = guest.ssh("ps -o rss= -p %s" % pid, check=False).stdout.strip()
        if held_kib and int(held_kib) * 1024 >= hog:
            break
        time.sleep(1)
    return hog


def test_check_mode_changes_nothing(guest, workdir, deployed, host_vars):
    before = guest.tree_digest("/etc", "/opt/vlserve")
    result = play(guest, workdir, "site.yml", check=True, **host_vars)
    assert result.returncode == 0, result.stdout[-4000:]
    assert recap(result)["changed"] == 0, result.stdout[-6000:]
    assert guest.tree_digest("/etc", "/opt/vlserve") == before


def test_worker_unit_exposure_is_at_most_2(guest, deployed):
    text = guest.ssh("systemd-analyze security --no-pager vlserve@0.service").stdout
    level = float(re.search(r"Overall exposure level for vlserve@0\.service: (\d+\.\d+)", text).group(1))
    assert level <= 2.0, text[-3000:]


def test_stop_and_start_the_whole_service(guest, deployed, host_vars):
    guest.ssh("systemctl stop vlserve.target")
    assert guest.ssh("systemctl list-units --state=running --no-legend 'vlserve*'").stdout.strip() == ""
    with pytest.raises(httpx.ConnectError):
        get(host_vars, "/v1/models", timeout=5)
    started = time.monotonic()
    guest.ssh("systemctl start vlserve.target")  # returns once every worker is ready (READY=1)
    assert ask(host_vars).status_code == 200
    assert time.monotonic() - started < 120


def traffic(host_vars) -> Traffic:
    """A client asking the host's front every few tenths of a second, started."""
    client = Traffic(lambda: ask(host_vars, timeout=60))
    client.start()
    return client


def main_pid(guest, index) -> str:
    return guest.ssh("systemctl show -p MainPID --value vlserve@%d.service" % index).stdout.strip()


def test_a_killed_worker_is_restarted_and_the_front_routes_around_it(guest, deployed, host_vars):
    before = main_pid(guest, 0)
    client = traffic(host_vars)
    time.sleep(3)
    guest.ssh("kill -9 %s" % before)
    deadline = time.monotonic() + 90
    while not (
        main_pid(guest, 0) not in ("0", before)
        and guest.ssh("systemctl is-active vlserve@0.service", check=False).stdout.strip() == "active"
    ):
        assert time.monotonic() < deadline, "systemd did not bring the killed worker back"
        time.sleep(1)
    time.sleep(3)
    outcomes = client.stop()
    failures = [o for o in outcomes if o.status != 200]
    assert len(outcomes) > 20
    assert len(failures) <= 1, failures  # at most the one request inside the killed worker


def test_a_changed_level_restarts_workers_one_at_a_time_without_a_failed_request(
    guest, workdir, deployed, host_vars, releases
):
    """int8 and a new release on a host that ran exact: each worker comes back on the new release
    with the int8 kernel (the compiler installed, the kernels built by the deploy's step before any
    worker restarted, loaded by both) and its weights rounded into the cache directory, and the other
    worker answers meanwhile."""
    pids = [main_pid(guest, 0), main_pid(guest, 1)]
    client = traffic(host_vars)
    changed = int8_vars(host_vars, releases)
    result = play(guest, workdir, "site.yml", **changed)
    outcomes = client.stop()
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Restart the workers one at a time" in result.stdout
    assert all(pid not in pids and pid != "0" for pid in (main_pid(guest, 0), main_pid(guest, 1)))
    assert outcomes and all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200]
    assert "VLSERVE_MAX_PIXELS=40000" in guest.ssh("cat /etc/vlserve/vlserve.env").stdout
    assert guest.ssh("readlink /opt/vlserve/current").stdout.strip() == "releases/" + release_name(releases["second"])
    for index in (0, 1):  # the workers run it: the script's interpreter is the release's own
        command = guest.ssh("tr '\\0' ' ' < /proc/%s/cmdline" % main_pid(guest, index)).stdout
        assert "releases/%s/venv/bin/python" % release_name(releases["second"]) in command, command
    plan = audit(guest, workdir, **changed)["plan"]
    for worker in plan["worker_list"]:
        info = httpx.get("http://127.0.0.1:%d/readyz" % worker["port"], timeout=10).json()
        assert info["quantize"] == "int8", info
        # built by the deploy's step, loaded by every worker (none compiles in its start)
        assert "loaded from /var/cache/vlserve/kernels/vlserve_kernels-" in info["kernels"], info
    record = json.loads(guest.ssh("cat /var/cache/vlserve/kernels/build.json").stdout)
    assert record["own"] and record["library"] in info["kernels"]
    for worker in plan["worker_list"]:  # start to ready, as systemd counts it (Type=notify), for the figures
        times = guest.ssh(
            "systemctl show -p ExecMainStartTimestampMonotonic -p ActiveEnterTimestampMonotonic --value vlserve@%d"
            % worker["index"]
        ).stdout.split()
        print("vlserve@%d started in %.1f s" % (worker["index"], (int(times[1]) - int(times[0])) / 1e6))
    # The Q8_0 tiles of the kernels loaded above, in their own file (vlserve/model/weightcache.py).
    assert "-int8-q8tiles.safetensors" in guest.ssh("ls /var/cache/vlserve/weights").stdout
    assert ask(host_vars).status_code == 200


@pytest.mark.skipif(native.cpu_tier()[0] is None, reason="this CPU runs none of vlserve's kernels: nothing to fail")
def test_a_host_whose_kernels_cannot_be_built_fails_unless_the_fallback_is_allowed(
    guest, workdir, deployed, host_vars, releases
):
    """The int8 plan of the test before, its compiler gone and its builds removed: the play stops at the
    kernels' step naming the cause, before any worker restarts; allowed, it warns; repaired, it builds."""
    int8 = int8_vars(host_vars, releases)
    pids = [main_pid(guest, 0), main_pid(guest, 1)]
    guest.ssh("for c in c++ g++; do mv /usr/bin/$c /usr/bin/$c.away; done; rm /var/cache/vlserve/kernels/*.so")
    try:
        refused = play(guest, workdir, "playbooks/deploy.yml", **int8)
        assert refused.returncode != 0
        assert "vlserve's kernels cannot serve on this host (stock kernels: no C++ compiler" in refused.stdout, (
            refused.stdout[-3000:]
        )
        assert "vlserve_deploy_kernels_fallback_ok" in refused.stdout
        allowed = play(guest, workdir, "playbooks/deploy.yml", **int8, vlserve_deploy_kernels_fallback_ok=True)
        assert allowed.returncode == 0, allowed.stdout[-4000:]
        said = " ".join(allowed.stdout.split())  # the callback may wrap a long message
        assert "so the workers decode on the stock kernels (stock kernels: no C++ compiler" in said, said[-3000:]
    finally:
        guest.ssh("for c in c++ g++; do mv /usr/bin/$c.away /usr/bin/$c; done")
    assert [main_pid(guest, 0), main_pid(guest, 1)] == pids  # nothing restarted on a build that failed
    repaired = play(guest, workdir, "playbooks/deploy.yml", **int8)
    assert repaired.returncode == 0, repaired.stdout[-4000:]
    assert json.loads(guest.ssh("cat /var/cache/vlserve/kernels/build.json").stdout)["built"] is True


def _broken_copy(release: dict, directory: pathlib.Path) -> str:
    """The same wheel with a Wheel-Version no pip installs: it builds, describes and copies, then fails."""
    target = directory / release["wheel"]
    with zipfile.ZipFile(release["path"]) as good, zipfile.ZipFile(target, "w") as broken:
        for info in good.infolist():
            body = good.read(info)
            if info.filename.endswith(".dist-info/WHEEL"):
                body = body.replace(b"Wheel-Version: 1.0", b"Wheel-Version: 9.0")
            broken.writestr(info, body)
    return str(target)


@pytest.mark.usefixtures("deployed")
def test_releases_switch_only_once_installed_and_the_oldest_are_pruned(guest, workdir, host_vars, releases, tmp_path):
    """Two kept: the first release, the second (the int8 test's), a broken third (refused, the second
    serving on) and the good third: the host holds the last two, runs the newest, and keeps one
    dependencies' virtualenv for all of them."""
    second, third = releases["second"], releases["third"]
    assert guest.ssh("readlink /opt/vlserve/current").stdout.strip() == "releases/" + release_name(second)
    client = traffic(host_vars)
    broken = dict(host_vars, vlserve_deploy_release_wheel=_broken_copy(third, tmp_path))
    refused = play(guest, workdir, "site.yml", **broken)
    outcomes = client.stop()
    assert refused.returncode != 0
    assert "did not install (Install the wheel" in refused.stdout, refused.stdout[-3000:]
    assert "the current release keeps serving" in refused.stdout
    assert guest.ssh("readlink /opt/vlserve/current").stdout.strip() == "releases/" + release_name(second)
    assert outcomes and all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200]
    result = play(guest, workdir, "site.yml", **dict(host_vars, vlserve_deploy_release_wheel=third["path"]))
    assert result.returncode == 0, result.stdout[-4000:]
    assert guest.ssh("readlink /opt/vlserve/current").stdout.strip() == "releases/" + release_name(third)
    installed = guest.ssh("/opt/vlserve/current/venv/bin/vlserve --version").stdout.strip()
    assert installed == "vlserve " + third["version"]
    held = guest.ssh("ls /opt/vlserve/releases").stdout.split()
    assert sorted(held) == sorted(release_name(r) for r in (second, third)), held
    assert len(guest.ssh("ls /opt/vlserve/deps").stdout.split()) == 1
    for index in (0, 1):
        command = guest.ssh("tr '\\0' ' ' < /proc/%s/cmdline" % main_pid(guest, index)).stdout
        assert "releases/%s/venv/bin/python" % release_name(third) in command, command
    assert ask(host_vars).status_code == 200


def test_every_command_runs_on_the_host_from_the_installed_release(guest, deployed):
    """No checkout on the host: each command of the current release, the benchmarks and the renderer included."""
    vlserve = "/opt/vlserve/current/venv/bin/vlserve"
    listed = guest.ssh(vlserve + " --help").stdout.split("COMMAND\n", 1)[1].split("\noptions:", 1)[0]
    commands = [line.split()[0] for line in listed.splitlines() if re.match(r"^    \S", line)]
    assert {"quant-check", "bench", "bench-decode", "render-units", "serve"} <= set(commands), commands
    guest.ssh("cd / && " + " && ".join("%s %s --help >/dev/null" % (vlserve, c) for c in commands))
    guest.ssh("cd / && %s quant-check --model /var/lib/vlserve/model --prompts 1 --answer-tokens 4" % vlserve)
    guest.ssh(
        "cd / && %s bench-decode --model /var/lib/vlserve/model --levels int8 --tokens 2 --rounds 1 "
        "--prompt-tokens 8" % vlserve
    )
    guest.ssh(
        "cd / && %s render-units --out /tmp/rendered --front-bind 127.0.0.1"
        " && test -f /tmp/rendered/etc/vlserve/haproxy.cfg" % vlserve
    )


def test_a_model_file_changed_on_the_controller_stops_the_play_naming_it(guest, workdir, deployed, host_vars, tmp_path):
    """One byte flipped in the controller's copy: the lock check fails before anything is copied or restarted."""
    tampered = tmp_path / "model"
    shutil.copytree(host_vars["vlserve_deploy_model_controller_dir"], tampered)
    weights = next(tampered.glob("*.safetensors"))
    body = bytearray(weights.read_bytes())
    body[len(body) // 2] ^= 1
    weights.write_bytes(bytes(body))
    pids = [main_pid(guest, 0), main_pid(guest, 1)]
    result = play(guest, workdir, "site.yml", **dict(host_vars, vlserve_deploy_model_controller_dir=str(tampered)))
    assert result.returncode != 0
    said = " ".join(result.stdout.split())  # the callback may wrap a long line
    assert "%s/%s does not match the model lock (sha256 " % (tampered, weights.name) in said, said[-3000:]
    assert [main_pid(guest, 0), main_pid(guest, 1)] == pids
    lock = json.dumps(host_vars["vlserve_deploy_model_lock"])
    verified = guest.ssh(
        "echo '%s' | /opt/vlserve/current/venv/bin/vlserve model verify /var/lib/vlserve/model --lock -" % lock
    )
    assert "matches the model lock" in verified.stdout


def test_the_front_enforces_the_upload_limit_and_the_clients_keys(guest, workdir, deployed, host_vars, releases):
    too_big = httpx.post(
        front(host_vars) + "/v1/chat/completions",
        content=b"x" * (21 * 2**20),
        timeout=60,
        headers={"Content-Type": "application/json", **default_key()},
        verify=trust(),
    )
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"
    # Out of the box: TLS by the private CA, one default client whose key only the controller holds.
    assert get(host_vars, "/v1/models", key=False).status_code == 401
    assert (CREDENTIALS["dir"] / "default-api-key").stat().st_mode & 0o777 == 0o600
    keys = {"web": "vls-web-" + "w" * 40, "batch": "vls-batch-" + "b" * 40}
    keyed = dict(
        host_vars,
        vlserve_deploy_release_wheel=releases["third"]["path"],  # what the host runs since the releases' test
        vlserve_clients=[{"name": name, "key": key} for name, key in keys.items()],
    )
    started = main_pid(guest, 0)
    result = play(guest, workdir, "site.yml", "-v", **keyed)
    assert result.returncode == 0, result.stdout[-4000:]
    assert main_pid(guest, 0) == started  # keys change the front's map only: no worker restarts
    assert get(host_vars, "/v1/models").status_code == 401  # the default client is gone
    report = json.dumps(audit(guest, workdir, **keyed))
    journal = guest.ssh("journalctl --no-pager -o cat").stdout
    for key in keys.values():
        assert get(host_vars, "/v1/models", key=False, headers={"Authorization": "Bearer " + key}).status_code == 200
        # no_log: the keys stay out of the play's output, even verbose; nor in the audit or the journal
        assert key not in result.stdout + result.stderr and key not in report and key not in journal
        # The host holds digests: no file under /etc or /opt has a key.
        assert guest.ssh("grep -rlF %s /etc /opt/vlserve /var/lib/vlserve" % key, check=False).stdout == ""
    modes = guest.ssh("stat -c '%a %U %G' /etc/vlserve/clients.map /etc/vlserve/tls/front.pem").stdout.split("\n")
    assert modes[:2] == ["640 root haproxy", "640 root haproxy"]
    # (The host keeps these keys: the tests after this one never ask its front.)


def test_a_bad_certificate_fails_the_play_before_any_change_naming_the_file(guest, workdir, deployed, host_vars):
    other = workdir / "other"
    other.mkdir(exist_ok=True)
    for name in ("a", "b"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(other / (name + ".key")), "-out", str(other / (name + ".crt")), "-days", "30",
             "-subj", "/CN=guest"],
            check=True, capture_output=True,
        )  # fmt: skip
    (other / "junk.key").write_text("not a key\n")
    before = guest.tree_digest("/etc", "/opt/vlserve")
    for cert, key, message in (
        ("a.crt", "b.key", "a.crt: does not match the key"),
        ("a.crt", "junk.key", "junk.key is not a PEM private key the controller can read"),
    ):
        result = play(
            guest, workdir, "site.yml",
            vlserve_deploy_front_tls_cert=str(other / cert), vlserve_deploy_front_tls_key=str(other / key), **host_vars,
        )  # fmt: skip
        assert result.returncode != 0
        assert message in " ".join(result.stdout.split()), result.stdout[-3000:]
    assert guest.tree_digest("/etc", "/opt/vlserve") == before


def test_a_missing_model_fails_the_unit_fast_and_the_host_gets_its_last_good_deployment_back(
    guest, workdir, deployed, host_vars, tmp_path
):
    """Last (it leaves the host on another model directory than the inventory's). An unpinned controller
    directory that is no checkpoint at all stops the play on the controller (taking its lock) before
    any change. Then the new units point at a checkpoint without weights; the worker stops at once
    naming it, the play puts the last good deployment back (its units and settings, the model
    directory they name), checks it, and fails naming the host and the cause."""
    empty = tmp_path / "no-model"
    empty.mkdir()
    (empty / "README").write_text("not a checkpoint\n")
    broken = dict(
        host_vars,
        vlserve_deploy_model_controller_dir=str(empty),
        vlserve_deploy_model_dir="/srv/no-model",
        vlserve_deploy_model_lock={},  # unpinned: locked once on the controller, then the worker finds the fault
    )
    pids = [main_pid(guest, 0), main_pid(guest, 1)]
    refused = play(guest, workdir, "playbooks/deploy.yml", **broken)
    assert refused.returncode != 0 and "has no config.json: not a Hugging Face checkpoint" in refused.stdout
    assert "Lock the controller's unpinned model" in refused.stdout and "changed: [guest]" not in refused.stdout
    assert [main_pid(guest, 0), main_pid(guest, 1)] == pids
    shutil.copy(pathlib.Path(host_vars["vlserve_deploy_model_controller_dir"]) / "config.json", empty)
    started = time.monotonic()
    result = play(guest, workdir, "site.yml", **broken)
    assert result.returncode != 0
    said = " ".join(result.stdout.split())
    assert "has no *.safetensors weights" in said, said[-3000:]
    assert "guest failed its rollout at" in said and "it runs its last good deployment" in said, said[-3000:]
    assert time.monotonic() - started < 400
    journal = guest.ssh("journalctl -u vlserve@0.service --no-pager -n 300 -o cat").stdout
    assert "cannot start: /srv/no-model has no *.safetensors weights" in journal
    # Back on what passed its gate last: the workers run and the front answers.
    assert guest.ssh("systemctl is-active vlserve@0.service vlserve@1.service", check=False).stdout.split() == [
        "active",
        "active",
    ]
    assert "/srv/no-model" not in guest.ssh("cat /etc/vlserve/vlserve.env").stdout
    assert ask(host_vars).status_code == 200
