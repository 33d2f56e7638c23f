"""A systemd-nspawn container booted from the harness rootfs: systemd as PID 1, reached over SSH.

What is real there and what is not is in tests/harness/README.md: units, daemon-reload, systemctl,
slices, apt and pip are; sysctls, cpusets, zram and cpufreq are not (the roles write their
config files there and the audit reports those knobs as not applicable in a container).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

from harness.host import CACHE, REPO, SshHost, key_for

SSH_PORT = 2222  # the rootfs's own sshd: 127.0.0.1:2222, for one container at a time
CGROUP_PARENTS = [pathlib.Path("/sys/fs/cgroup/unified"), pathlib.Path("/sys/fs/cgroup/systemd")]


def ensure_rootfs(release: str = "bookworm", rebuild: bool = False) -> pathlib.Path:
    """Build a release's rootfs once per machine (about a minute); CI machines start without it."""
    rootfs = CACHE / release
    marker = rootfs / "etc" / "ssh" / "sshd_config.d" / "vlserve-harness.conf"
    if rebuild or not marker.exists():
        subprocess.run([str(REPO / "tests" / "harness" / "build-rootfs"), str(rootfs), release], check=True)
    return rootfs


class NspawnHost(SshHost):
    """`with NspawnHost() as host:` boots a throwaway copy of the rootfs (`-x`) and powers it off after."""

    def __init__(self, name: str = "vlserve-guest", release: str = "bookworm", address: str = "127.0.0.1"):
        """`address`: a loopback address of its own (127.0.1.N) for hosts that run side by side: sshd
        listens there on port 22, and the tests bind the host's services there too."""
        self.name, self.release, self.address = name, release, address
        self.key = key_for(release)
        self.port = SSH_PORT if address == "127.0.0.1" else 22
        self.cgroup_dirs = [parent / ("vlserve-harness-" + name) for parent in CGROUP_PARENTS]
        self.process: subprocess.Popen | None = None
        self.console = CACHE / ("%s.console.log" % name)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> NspawnHost:
        rootfs = ensure_rootfs(self.release)
        for directory in self.cgroup_dirs:
            _kill_every_process_in(directory)  # a container of this name left by an interrupted run
            if directory.parent.is_dir():
                directory.mkdir(exist_ok=True)
        self._refuse_a_taken_ssh_address()
        env = dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1")
        nspawn = [
            "systemd-nspawn",
            "-q",
            "-D",
            str(rootfs),
            "-M",
            self.name,
            "-b",
            "-x",
            "--register=no",
            "--keep-unit",
        ]
        if self.address != "127.0.0.1":  # its own sshd address, over the rootfs's drop-in
            sshd = CACHE / ("%s.sshd.conf" % self.name)
            sshd.write_text("Port 22\nListenAddress %s\nPermitRootLogin prohibit-password\nUseDNS no\n" % self.address)
            nspawn.append("--bind-ro=%s:/etc/ssh/sshd_config.d/vlserve-harness.conf" % sshd)
        # Moved into a cgroup of its own first, so the container's payload cgroups do not land in the root.
        enter = "".join('echo $$ > "%s/cgroup.procs"; ' % d for d in self.cgroup_dirs if d.is_dir())
        with open(self.console, "wb") as console:
            self.process = subprocess.Popen(
                ["sh", "-c", enter + 'exec "$@"', "sh", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            self.wait_running(timeout=120)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def power_off_hard(self) -> None:
        """As if the machine lost power: SIGKILL to the container's PID 1 takes every process with it."""
        init = _child_of(self.process.pid) if self.alive() else None
        if init:
            os.kill(init, signal.SIGKILL)
        self.process.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            init = _child_of(self.process.pid)
            if init:
                os.kill(init, signal.SIGRTMIN + 3)  # systemd: clean poweroff
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # The container's init first: killing only systemd-nspawn can leave init and its
                # sshd running, and the next host booted on this address would be reached there.
                init = _child_of(self.process.pid)
                if init:
                    os.kill(init, signal.SIGKILL)
                self.process.kill()
                self.process.wait()
        for directory in self.cgroup_dirs:
            _kill_every_process_in(directory)
            # The container's own cgroups (payload, supervisor) go too, deepest first, once empty.
            for path in [*sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True), directory]:
                if path.is_dir():
                    with contextlib.suppress(OSError):  # still in use: reused next time
                        path.rmdir()

    def _refuse_a_taken_ssh_address(self) -> None:
        """Booting while another sshd holds the guest's address would test that other machine."""
        deadline = time.monotonic() + 10  # a container powering off just now releases it shortly
        while True:
            with socket.socket() as probe:
                probe.settimeout(1)
                if probe.connect_ex((self.address, self.port)) != 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "%s:%d already answers before %s boots: a container left by another run? "
                    "(ps -ef | grep systemd-nspawn; ss -ltnp)" % (self.address, self.port, self.name)
                )
            time.sleep(1)


def _kill_every_process_in(directory: pathlib.Path) -> None:
    """SIGKILL whatever still runs in a container's cgroup tree (cgroup.kill where the kernel has it)."""
    if not directory.is_dir():
        return
    kill = directory / "cgroup.kill"
    if kill.exists():
        with contextlib.suppress(OSError):
            kill.write_text("1")
            return
    for procs in directory.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


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
