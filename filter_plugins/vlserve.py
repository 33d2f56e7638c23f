"""Jinja filters for the vlserve roles, from the vlserve package's own files (one source for both)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "service" / "vlserve"


def _load(name: str):
    """A module (or subpackage) of the vlserve package by path, so the controller needs nothing installed."""
    qualified = "vlserve_for_filters_" + name
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


class FilterModule:
    def filters(self):
        return {
            # [0, 1, 2, 5] -> "0-2,5", the form of AllowedCPUs=, taskset and the kernel
            "vlserve_cpu_list": _load("sizing").format_cpu_list,
            # plan + the deploy role's options -> the unit templates' context
            "vlserve_units_context": _load("units").units_context,
            # {name: value} -> one line per unknown setting or value a worker would refuse
            "vlserve_settings_problems": lambda values, prefix="": _load("settings").settings_problems(values, prefix),
        }
