"""Jinja filters for the vlserve roles, from the vlserve package's own files (one source for both)."""

from __future__ import annotations

import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _REPO / "service" / "vlserve"


def _load(name: str):
    """A module (or subpackage) of the checkout's vlserve package by its path below it ("ops/units").

    The roles run from a checkout, so its own package is what they render with: its directory goes
    first on the path (the controller needs nothing installed, and an installed release of another
    version does not stand in for it)."""
    import importlib  # noqa: PLC0415

    if str(_PACKAGE.parent) not in sys.path:
        sys.path.insert(0, str(_PACKAGE.parent))
    return importlib.import_module("vlserve." + name.replace("/", "."))


def _tree_digest(paths: list[str], contents: bool = True) -> str:
    """sha256 over the names and contents (or, without `contents`, sizes and times) of every file below
    the paths, in a stable order."""
    import hashlib  # noqa: PLC0415

    digest = hashlib.sha256()
    for root in paths:
        base = pathlib.Path(root).resolve()
        files = sorted(p for p in ([base] if base.is_file() else base.rglob("*")) if p.is_file())
        for path in files:
            if "__pycache__" in path.parts:
                continue
            if contents:
                body = path.read_bytes()
            else:
                info = path.stat()
                body = b"%d %d" % (info.st_size, info.st_mtime_ns)
            digest.update(str(path.relative_to(base.parent)).encode() + b"\0" + body + b"\0")
    return digest.hexdigest()


def _clients_problem(entries, source: str = "clients") -> str:
    clients = _load("ops/clients")
    try:
        clients.parse_clients(entries, source)
    except clients.ClientsError as error:
        return str(error)
    return ""


def _pem(files: list[str]) -> str:
    """A certificate and its key, files on the controller, as one PEM (HAProxy's `crt`); empty while
    either is missing (check mode before the controller made them)."""
    texts = []
    for name in files:
        path = pathlib.Path(name)
        text = path.read_text().strip() if path.is_file() else ""
        if not text:
            return ""
        texts.append(text + "\n")
    return "".join(texts)


class FilterModule:
    def filters(self):
        return {
            # [0, 1, 2, 5] -> "0-2,5", the form of AllowedCPUs=, taskset and the kernel
            "vlserve_cpu_list": _load("sizing").format_cpu_list,
            # plan + the deploy role's options -> the unit templates' context
            "vlserve_units_context": _load("ops/units").units_context,
            # the service hosts of a group + hostvars -> the fleet front's servers, then its template context
            "vlserve_fleet_backends": lambda hosts, hostvars: _load("ops/units").fleet_backends(hosts, hostvars),
            "vlserve_fleet_context": _load("ops/units").fleet_context,
            # the service hosts + the fleet fronts + hostvars -> Prometheus's target groups per scrape job
            "vlserve_scrape_targets": lambda hosts, fronts, hostvars: _load("ops/monitoring").scrape_targets(
                hosts, fronts, hostvars
            ),
            # the fleet fronts + hostvars + the peers port -> the peers that share counters (several fronts)
            "vlserve_fleet_peers": lambda fronts, hostvars, port: _load("ops/units").fleet_peers(
                fronts, hostvars, port
            ),
            # the API's client list -> '' or one line naming the client and its fault (never its key)
            "vlserve_clients_problem": _clients_problem,
            # a front's context -> '' or why it may not listen where it is told to (no TLS or keys)
            "vlserve_exposure_problem": lambda front: _load("ops/units").exposure_problem(front) or "",
            # [certificate, key] files on the controller -> one PEM, or '' while either is missing
            "vlserve_pem": _pem,
            # files and directories on the controller -> one sha256 of their contents (the rollout's fingerprint)
            "vlserve_tree_digest": _tree_digest,
            # every host's audit report -> the fleet's summary, and its table
            "vlserve_fleet_summary": _load("ops/audit").fleet_summary,
            "vlserve_render_fleet": _load("ops/audit").render_fleet,
            # {name: value} -> one line per unknown setting or value a worker would refuse
            "vlserve_settings_problems": lambda values, prefix="": _load("settings").settings_problems(values, prefix),
        }
