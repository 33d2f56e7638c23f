"""A QEMU VM (software emulation) booted from the harness rootfs: a real kernel of its own.

Where the nspawn tier cannot go: sysctls take effect, zram swap exists, cgroup v2 cpusets apply
(tests/harness/README.md). /dev/kvm here cannot boot a stock kernel, so this is TCG: slow (seconds per
Ansible task), and kept to the kernel-level checks.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

from harness import nspawn
from harness.host import SshHost, key_for


def ensure_image(release: str = "bookworm", rebuild: bool = False) -> pathlib.Path:
    """A release's VM image (kernel, initrd, disk), built from its rootfs once per machine."""
    rootfs = nspawn.ensure_rootfs(release)
    image_dir = nspawn.CACHE / ("vm-" + release)
    builder = nspawn.REPO / "tests" / "harness" / "build-vm-image"
    # An image built by another version of the script is rebuilt, never reused.
    stamp, built_by = image_dir / "built-by", hashlib.sha256(builder.read_bytes()).hexdigest()
    if rebuild or not (image_dir / "disk.img").exists() or not stamp.exists() or stamp.read_text() != built_by:
        subprocess.run([str(builder), str(rootfs), str(image_dir)], check=True)
        stamp.write_text(built_by)
    return image_dir


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class QemuHost(SshHost):
    """`with QemuHost() as vm:` boots a throwaway overlay of the image and powers it off after."""

    def __init__(self, memory_mib: int = 8192, cpus: int = 2, release: str = "bookworm"):
        self.memory_mib, self.cpus, self.release = memory_mib, cpus, release
        self.key = key_for(release)
        self.port = _free_port()
        self.workdir: pathlib.Path | None = None
        self.pid: int | None = None

    def __enter__(self) -> QemuHost:
        image = ensure_image(self.release)
        self.workdir = pathlib.Path(
            subprocess.run(
                ["mktemp", "-d", "/var/tmp/vlserve-vm.XXXXXX"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
        overlay = self.workdir / "overlay.qcow2"
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image / "disk.img"), "-F", "raw", str(overlay)],
            check=True,
        )
        self.console = self.workdir / "console.log"
        subprocess.run(
            [
                "qemu-system-x86_64",
                "-accel",
                "tcg,thread=multi",
                "-cpu",
                "max",
                "-machine",
                "q35",
                "-smp",
                str(self.cpus),
                "-m",
                str(self.memory_mib),
                "-kernel",
                str(image / "vmlinuz"),
                "-initrd",
                str(image / "initrd.img"),
                "-append",
                "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1",
                "-drive",
                "file=%s,format=qcow2,if=virtio,cache=unsafe" % overlay,
                "-netdev",
                "user,id=n0,hostfwd=tcp:127.0.0.1:%d-:22" % self.port,
                "-device",
                "virtio-net-pci,netdev=n0",
                "-display",
                "none",
                "-serial",
                "file:%s" % self.console,
                "-monitor",
                "none",
                "-daemonize",
                "-pidfile",
                str(self.workdir / "qemu.pid"),
            ],
            check=True,
        )
        self.pid = int((self.workdir / "qemu.pid").read_text())
        try:
            self.wait_running(timeout=300)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def alive(self) -> bool:
        return self.pid is not None and pathlib.Path("/proc/%d" % self.pid).exists()

    def __exit__(self, *exc) -> None:
        if self.pid:
            self.ssh("systemctl poweroff", timeout=20, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and pathlib.Path("/proc/%d" % self.pid).exists():
                time.sleep(0.5)
            if pathlib.Path("/proc/%d" % self.pid).exists():
                os.kill(self.pid, signal.SIGKILL)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def available() -> str | None:
    reason = nspawn.available()
    if reason:
        return reason
    for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return "needs %s (scripts/bootstrap --test installs it)" % tool
    return None
