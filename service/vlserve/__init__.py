"""vlserve: size, tune and serve Qwen3-VL on CPU-only hosts."""

__version__ = "0.1.0"
