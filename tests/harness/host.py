"""What both kinds of harness host share: SSH on a loopback port, an inventory, a digest of files."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
CACHE = pathlib.Path(os.environ.get("VLSERVE_HARNESS_DIR", "/var/tmp/vlserve-harness"))
RELEASES = ("bookworm", "trixie")  # Debian 12 and 13: the nspawn tuning tier boots both
# The QEMU tier's kernel-level checks boot only the older kernel (Debian 12's 6.1): under software
# emulation each boot and Ansible run costs minutes, and CI's time is bounded.
KERNEL_RELEASES = ("bookworm",)


def key_for(release: str) -> pathlib.Path:
    """Root's SSH key for hosts of a release, authorized in its tree by build-rootfs."""
    return CACHE / (release + ".key")


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


class SshHost:
    """A booted host reached as root over SSH on 127.0.0.1:`port`; subclasses boot and stop it."""

    port: int
    console: pathlib.Path
    key: pathlib.Path
    address: str = "127.0.0.1"

    def alive(self) -> bool:
        raise NotImplementedError

    def wait_running(self, timeout: float) -> None:
        """Until systemd says the boot is done (running or degraded), or the host dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError("the host stopped: %s" % self.console.read_text(errors="replace")[-3000:])
            result = self.ssh("systemctl is-system-running --wait", timeout=120, check=False)
            if result.stdout.strip() in ("running", "degraded"):
                return
            time.sleep(0.5)
        raise RuntimeError("the host did not come up: %s" % self.console.read_text(errors="replace")[-3000:])

    def ssh(self, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["ssh", "-i", str(self.key), "-p", str(self.port), *SSH_OPTIONS, "root@" + self.address, command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError("%s failed (%d): %s%s" % (command, result.returncode, result.stdout, result.stderr))
        return result

    def put(self, *local: pathlib.Path, to: str) -> None:
        """Copy local files into the host's directory `to` (made if missing)."""
        self.ssh("mkdir -p %s" % to)
        subprocess.run(
            [
                "scp",
                "-q",
                "-i",
                str(self.key),
                "-P",
                str(self.port),
                *SSH_OPTIONS,
                *map(str, local),
                "root@%s:%s/" % (self.address, to),
            ],
            check=True,
            timeout=300,
        )

    def inventory(self, directory: pathlib.Path, **host_vars) -> pathlib.Path:
        return write_inventory(directory, self, **host_vars)

    def tree_digest(self, *paths: str) -> str:
        """One line per file under the paths: path, mode, size and sha256; compare two to see any change."""
        command = "find %s -xdev -type f -print0 2>/dev/null | sort -z | xargs -0 -r sha256sum; " % " ".join(paths)
        command += "find %s -xdev -printf '%%p %%m %%s %%l\\n' 2>/dev/null | sort" % " ".join(paths)
        return self.ssh(command).stdout


def connection_vars(host: SshHost) -> dict:
    """How Ansible reaches a harness host: root over SSH on its loopback address, with its key."""
    return {
        "ansible_host": host.address,
        "ansible_port": host.port,
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(host.key),
        "ansible_ssh_common_args": " ".join(SSH_OPTIONS),
        "ansible_python_interpreter": "/usr/bin/python3",
    }


def write_inventory(directory: pathlib.Path, host: SshHost, **host_vars) -> pathlib.Path:
    """An inventory that reaches a harness host on its loopback address as `guest`, with extra host variables."""
    values = {**connection_vars(host), **host_vars}
    path = directory / "inventory.json"
    path.write_text(json.dumps({"all": {"hosts": {"guest": values}}}, indent=2))
    return path
