"""A systemd-nspawn container booted from the harness rootfs: systemd as PID 1, reached over SSH.

What is real there and what is not is in shared/HARNESS.md: units, daemon-reload, systemctl,
slices, apt and pip are; sysctls, cpusets, zram and cpufreq are not (the roles write their
config files there and the audit reports those knobs as not applicable in a container).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
CACHE = pathlib.Path(os.environ.get("VLSERVE_HARNESS_DIR", "/var/tmp/vlserve-harness"))
ROOTFS = CACHE / "bookworm"
KEY = CACHE / "bookworm.key"
SSH_PORT = 2222  # fixed in the rootfs: one container at a time
CGROUP_DIRS = [
    pathlib.Path("/sys/fs/cgroup/unified/vlserve-harness"),
    pathlib.Path("/sys/fs/cgroup/systemd/vlserve-harness"),
]
SSH_OPTIONS = [
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "UserKnownHostsFile=/dev/null",
    "-o",
    "LogLevel=ERROR",
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=5",
]


def ensure_rootfs(rebuild: bool = False) -> pathlib.Path:
    """Build the rootfs once per machine (about a minute); CI machines start without it."""
    marker = ROOTFS / "etc" / "ssh" / "sshd_config.d" / "vlserve-harness.conf"
    if rebuild or not marker.exists():
        subprocess.run([str(REPO / "tests" / "harness" / "build-rootfs"), str(ROOTFS)], check=True)
    return ROOTFS


class NspawnHost:
    """`with NspawnHost() as host:` boots a throwaway copy of the rootfs (`-x`) and powers it off after."""

    def __init__(self, name: str = "vlserve-guest"):
        self.name = name
        self.process: subprocess.Popen | None = None
        self.console = CACHE / ("%s.console.log" % name)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NspawnHost:
        ensure_rootfs()
        for directory in CGROUP_DIRS:
            if directory.parent.is_dir():
                directory.mkdir(exist_ok=True)
        env = dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1")
        nspawn = [
            "systemd-nspawn",
            "-q",
            "-D",
            str(ROOTFS),
            "-M",
            self.name,
            "-b",
            "-x",
            "--register=no",
            "--keep-unit",
        ]
        # Moved into a cgroup of its own first, so the container's payload cgroups do not land in the root.
        enter = "".join('echo $$ > "%s/cgroup.procs"; ' % d for d in CGROUP_DIRS if d.is_dir())
        with open(self.console, "wb") as console:
            self.process = subprocess.Popen(
                ["sh", "-c", enter + 'exec "$@"', "sh", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            self.wait_running()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_running(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("systemd-nspawn exited: %s" % self.console.read_text(errors="replace")[-2000:])
            result = self.ssh("systemctl is-system-running --wait", timeout=60, check=False)
            if result.stdout.strip() in ("running", "degraded"):
                return
            time.sleep(0.5)
        raise RuntimeError("the container did not come up: %s" % self.console.read_text(errors="replace")[-2000:])

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            init = _child_of(self.process.pid)
            if init:
                os.kill(init, signal.SIGRTMIN + 3)  # systemd: clean poweroff
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for directory in CGROUP_DIRS:
            # The container's own cgroups (payload, supervisor) go too, deepest first, once empty.
            for path in [*sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True), directory]:
                if path.is_dir():
                    with contextlib.suppress(OSError):  # still in use: reused next time
                        path.rmdir()

    # -- talking to it ------------------------------------------------------------------------

    def ssh(self, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["ssh", "-i", str(KEY), "-p", str(SSH_PORT), *SSH_OPTIONS, "root@127.0.0.1", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError("%s failed (%d): %s%s" % (command, result.returncode, result.stdout, result.stderr))
        return result

    def inventory(self, directory: pathlib.Path, **host_vars) -> pathlib.Path:
        return write_inventory(directory, SSH_PORT, **host_vars)

    def tree_digest(self, *paths: str) -> str:
        """One line per file under the paths: path, mode, size and sha256; compare two to see any change."""
        command = "find %s -xdev -type f -print0 2>/dev/null | sort -z | xargs -0 -r sha256sum; " % " ".join(paths)
        command += "find %s -xdev -printf '%%p %%m %%s %%l\\n' 2>/dev/null | sort" % " ".join(paths)
        return self.ssh(command).stdout


def write_inventory(directory: pathlib.Path, port: int, **host_vars) -> pathlib.Path:
    """An inventory that reaches a harness host on a loopback port as `guest`, with extra host variables."""
    values = {
        "ansible_host": "127.0.0.1",
        "ansible_port": port,
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(KEY),
        "ansible_ssh_common_args": " ".join(SSH_OPTIONS),
        "ansible_python_interpreter": "/usr/bin/python3",
        **host_vars,
    }
    path = directory / "inventory.json"
    path.write_text(json.dumps({"all": {"hosts": {"guest": values}}}, indent=2))
    return path


def _child_of(pid: int) -> int | None:
    children = pathlib.Path("/proc/%d/task/%d/children" % (pid, pid))
    try:
        first = children.read_text().split()
    except OSError:
        return None
    return int(first[0]) if first else None


def available() -> str | None:
    """Why the nspawn tier cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("systemd-nspawn", "debootstrap", "ssh"):
        if shutil.which(tool) is None:
            return "needs %s (scripts/bootstrap --test installs it)" % tool
    return None
