"""vlserve: size, tune and serve Qwen3-VL on CPU-only hosts."""

from importlib import metadata

try:  # a release's version names the commit it was built from (scripts/release)
    __version__ = metadata.version("vlserve")
except metadata.PackageNotFoundError:  # the source tree, not installed
    __version__ = "0.1.0"
