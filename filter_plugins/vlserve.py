"""Jinja filters for the vlserve roles, from the vlserve package's own files (one source for both)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _REPO / "service" / "vlserve"


def _load(name: str):
    """A module (or subpackage) of the vlserve package by its path below it ("ops/units"), so the
    controller needs nothing installed."""
    qualified = "vlserve_for_filters_" + name.replace("/", "_")
    if qualified not in sys.modules:
        package = _PACKAGE / name
        if package.is_dir():  # its relative imports resolve below the qualified name
            spec = importlib.util.spec_from_file_location(
                qualified, package / "__init__.py", submodule_search_locations=[str(package)]
            )
        else:
            spec = importlib.util.spec_from_file_location(qualified, _PACKAGE / (name + ".py"))
        sys.modules[qualified] = importlib.util.module_from_spec(spec)  # dataclasses look their module up here
        spec.loader.exec_module(sys.modules[qualified])
    return sys.modules[qualified]


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
            # files and directories on the controller -> one sha256 of their contents (the rollout's fingerprint)
            "vlserve_tree_digest": _tree_digest,
            # every host's audit report -> the fleet's summary, and its table
            "vlserve_fleet_summary": _load("ops/audit").fleet_summary,
            "vlserve_render_fleet": _load("ops/audit").render_fleet,
            # {name: value} -> one line per unknown setting or value a worker would refuse
            "vlserve_settings_problems": lambda values, prefix="": _load("settings").settings_problems(values, prefix),
        }
