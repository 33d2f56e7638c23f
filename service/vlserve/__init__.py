"""vlserve: size, tune and serve Qwen3-VL on CPU-only hosts."""

import os
from importlib import metadata

# The CPUs this process was started on, read before anything imports torch: with a worker's
# OMP_PROC_BIND and OMP_PLACES in the environment, libgomp binds the first thread to the first place
# as torch loads, and every later read of this thread's mask (and every child it starts) sees one CPU.
# The probe plans with this set (sizing.probing); None where the OS has no affinity call.
LAUNCH_AFFINITY: frozenset[int] | None = (
    frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
)

try:  # a release's version names the commit it was built from (scripts/release)
    __version__ = metadata.version("vlserve")
except metadata.PackageNotFoundError:  # the source tree, not installed
    __version__ = "0.1.0"
