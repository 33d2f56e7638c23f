"""HAProxy as the fronts run it, for tests on this machine: the distribution's own build, unpacked.

Debian's haproxy package (and the two libraries it links that this machine may lack) is downloaded
and unpacked into the harness cache, never installed: no haproxy.service starts here, nothing under
/etc changes. A front's rendered files are written below a temporary root and its absolute paths
(/etc/vlserve, /run/vlserve-*) pointed there, so the configuration under test is the one the roles
write, run as a plain process on loopback.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import ssl
import subprocess
import time

import httpx

from harness.debs import environment, unpacked
from vlserve.sizing.contract import FLEET_CLIENT_CN

# (socat: what the fleet front's unit saves HAProxy's server state with)
PACKAGES = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1", "socat", "libwrap0")
RENDERED_PATHS = r"(?<![\w/])/(etc/vlserve|run/vlserve-[a-z]+|var/lib/vlserve-[a-z]+)/"


def haproxy_binary() -> tuple[pathlib.Path, dict[str, str]]:
    """The haproxy executable and the environment that finds its libraries."""
    root = unpacked("haproxy", PACKAGES, "usr/bin/socat")
    return root / "usr" / "sbin" / "haproxy", environment(root)


def socat_binary() -> pathlib.Path:
    return unpacked("haproxy", PACKAGES, "usr/bin/socat") / "usr" / "bin" / "socat"


def self_signed(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A certificate for 127.0.0.1 and its key in one PEM (HAProxy's form), and the certificate alone
    (what a client trusts)."""
    key, cert = directory / "front.key", directory / "front.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    pem = directory / "front.pem"
    pem.write_text(cert.read_text() + key.read_text())
    return pem, cert


def issue(
    directory: pathlib.Path, name: str, common_name: str, usage: str, ca: pathlib.Path | None = None
) -> pathlib.Path:
    """A certificate signed by the CA in `directory` (made by the first call, `ca` None): its chain and
    key in one PEM, as HAProxy takes it. `usage`: serverAuth (for 127.0.0.1) or clientAuth."""
    key, cert = directory / (name + ".key"), directory / (name + ".crt")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key)]
    if ca is None:
        subprocess.run(
            ["openssl", "req", "-x509", *ec, "-out", str(cert), "-days", "2", "-subj", "/CN=" + common_name,
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert
    extensions = directory / (name + ".ext")
    names = "\nsubjectAltName=IP:127.0.0.1" if usage == "serverAuth" else ""
    extensions.write_text("extendedKeyUsage=%s%s\n" % (usage, names))
    request = subprocess.run(
        ["openssl", "req", "-new", *ec, "-subj", "/CN=" + common_name], check=True, capture_output=True
    ).stdout
    subprocess.run(
        ["openssl", "x509", "-req", "-CA", str(ca), "-CAkey", str(ca.with_suffix(".key")), "-days", "2",
         "-extfile", str(extensions), "-out", str(cert)],
        input=request, check=True, capture_output=True,
    )  # fmt: skip
    pem = directory / (name + ".pem")
    pem.write_text(cert.read_text() + key.read_text())
    return pem


def fleet_certificates(directory: pathlib.Path, **clients: str) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """A private CA and what the roles make with it: the host front's and the fleet front's
    certificates (for 127.0.0.1) and the fleet front's client certificate ("client", also what the
    peers show one another); `clients`: more client certificates, name -> common name."""
    ca = issue(directory, "ca", "test private CA", "")
    pems = {
        "host": issue(directory, "host", "127.0.0.1", "serverAuth", ca),
        "fleet": issue(directory, "fleet", "127.0.0.1", "serverAuth", ca),
        "client": issue(directory, "client", FLEET_CLIENT_CN + " f1", "clientAuth,serverAuth", ca),
    }
    for name, common_name in clients.items():
        pems[name] = issue(directory, name, common_name, "clientAuth", ca)
    return ca, pems


class Front:
    """One HAProxy process running a rendered front's files (a tree as render-units writes it)."""

    def __init__(self, tree: pathlib.Path, config: str, unit: str | None = None):
        """`unit`: the rendered systemd unit whose ExecReload and ExecStop lines reload() and stop() run."""
        self.tree = tree
        self.binary, self.environment = haproxy_binary()
        self.config = tree / config.lstrip("/")
        self.log = tree / "haproxy.log"
        # The rendered paths, pointed below the tree (the runtime socket's directory too).
        self.config.write_text(self.below_tree(self.config.read_text()))
        self.unit = tree / unit.lstrip("/") if unit else None
        for directory in ("run/vlserve-front", "run/vlserve-fleet", "var/lib/vlserve-fleet"):
            (tree / directory).mkdir(parents=True, exist_ok=True)
        for map_file in tree.rglob("*.map"):
            map_file.chmod(0o600)
        self.process: subprocess.Popen | None = None

    def below_tree(self, text: str) -> str:
        return re.sub(RENDERED_PATHS, lambda m: "%s/%s/" % (self.tree, m.group(1)), text)

    def unit_commands(self, key: str) -> list[list[str]]:
        """The unit's Exec<key>= lines as this machine runs them: the unpacked haproxy and socat, the
        tree's paths, the master's pid for $MAINPID (systemd's "-" prefix dropped: tests want to know)."""
        assert self.unit is not None and self.process is not None
        commands = []
        for line in self.unit.read_text().splitlines():
            if line.startswith("Exec%s=" % key):
                command = self.below_tree(line.split("=", 1)[1].lstrip("-"))
                command = command.replace("/usr/sbin/haproxy", str(self.binary)).replace(
                    "$MAINPID", str(self.process.pid)
                )
                command = command.replace("/usr/bin/socat", str(socat_binary()))
                commands.append(shlex.split(command))
        return commands

    def check(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.binary), "-c", "-q", "-f", str(self.config)],
            env=self.environment,
            capture_output=True,
            text=True,
            check=False,
        )

    def start(self, url: str, ca: ssl.SSLContext | bool = False) -> Front:
        """Run it in master-worker mode, as the unit does, until `url` answers."""
        self.process = subprocess.Popen(
            [str(self.binary), "-W", "-db", "-f", str(self.config)],
            env=self.environment,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                httpx.get(url, verify=ca, timeout=2)
                return self
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("the front did not answer at %s: %s" % (url, self.log.read_text()[-2000:]))

    def reload(self) -> None:
        """What `systemctl reload` does to the unit: its ExecReload lines where the unit is given, else
        USR2 to the master (what the last of them sends), which starts new workers and lets the old
        ones finish their streams."""
        assert self.process is not None
        if self.unit is None:
            self.process.send_signal(12)  # SIGUSR2
            return
        for command in self.unit_commands("Reload"):
            subprocess.run(command, env=self.environment, check=True, capture_output=True, timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            for command in self.unit_commands("Stop") if self.unit is not None else []:
                subprocess.run(command, env=self.environment, check=True, capture_output=True, timeout=30)
            self.process.terminate()
            self.process.wait(timeout=20)
