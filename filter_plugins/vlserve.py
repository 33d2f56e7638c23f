"""Jinja filters for the vlserve roles, from the sizing engine itself (one source for CPU lists)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_NAME = "vlserve_sizing_for_filters"
if _NAME not in sys.modules:  # the file itself, so the controller needs nothing installed for it
    _spec = importlib.util.spec_from_file_location(
        _NAME, pathlib.Path(__file__).resolve().parent.parent / "service" / "vlserve" / "sizing.py"
    )
    sys.modules[_NAME] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up here
    _spec.loader.exec_module(sys.modules[_NAME])
sizing = sys.modules[_NAME]


class FilterModule:
    def filters(self):
        return {
            # [0, 1, 2, 5] -> "0-2,5", the form of AllowedCPUs=, taskset and the kernel
            "vlserve_cpu_list": sizing.format_cpu_list,
        }
