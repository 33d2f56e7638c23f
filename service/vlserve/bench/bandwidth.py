"""The memory-bandwidth bound of decoding: how fast the weights can be read, and so how many tokens
per second one stream could decode at best.

Decoding one token reads every weight of the language model once (the output head included; of
the input embedding only one row), so tokens/s <= read bandwidth / bytes of those weights.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from vlserve.sizing import QUANTIZED_BYTES_PER_32_WEIGHTS

if TYPE_CHECKING:
    from vlserve.kernels.native import Kernels

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "bfloat16": 2, "float32": 4}


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), 0 when unknown."""
    largest = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (ValueError, IndexError):
            continue
        largest = max(largest, value)
    return largest


class MemoryReader:
    """A buffer in 2 MiB pages and the readers that time a pass over it: torch's (a float32 dot product
    of the buffer with itself) and, where `kernels` has it, vlserve's own (kernels/stream_read.cpp, every
    line prefetched ahead). torch's read is not the memory's limit: on the AMX Xeon VM the prefetched
    read went about 5% faster (kernels/stream_read.cpp has the figures).

    The buffer is at least 1 GiB and at least 4 times the last-level cache, so the reads come from memory,
    and it sits in 2 MiB pages where the kernel gives them, as the weights do (vlserve/model/pages.py):
    the same read from scattered 4 KiB pages went at 26 GB/s against 34 on the AMX Xeon VM. A bound
    from either slower read would make every decode step look nearer its bound than it was.
    A context manager: the buffer is mapped and faulted in on entry, and unmapped on exit."""

    def __init__(self, threads: int, size_bytes: int | None = None, kernels: Kernels | None = None) -> None:
        self.threads = threads
        self.cache = last_level_cache_bytes()
        self.size = size_bytes or max(2**30, 4 * self.cache)
        self.kernels = kernels
        self.huge_page_bytes = 0

    def __enter__(self) -> MemoryReader:
        import torch  # noqa: PLC0415 - torch's threaded BLAS gives a vectorised multi-threaded read

        from vlserve.model import pages  # noqa: PLC0415 - with torch

        self._mapping, offset, address = pages.anonymous_huge(self.size)
        self._buffer = torch.frombuffer(self._mapping, dtype=torch.float32, offset=offset, count=self.size // 4)
        self._readers = {"torch.dot": lambda floats: torch.dot(floats, floats)}
        own = self.kernels.stream_read() if self.kernels is not None else None
        if own is not None:
            self._readers["vlserve"] = lambda floats: own(floats.view(torch.uint8))
        with self._threads():
            self._buffer.fill_(1.0)  # fault the pages in
        self.huge_page_bytes = pages.smaps_field([address], "AnonHugePages").get(address, 0)
        return self

    def __exit__(self, *_: object) -> None:
        del self._buffer, self._readers  # the mapping closes only once no tensor views it
        self._mapping.close()

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        import torch  # noqa: PLC0415

        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def speeds(self) -> dict[str, float]:
        """One pass of each reader over the buffer, in turn: bytes/s by reader name."""
        found = {}
        with self._threads():
            for name, read in self._readers.items():
                started = time.perf_counter()
                read(self._buffer)
                found[name] = self.size / (time.perf_counter() - started)
        return found


def measure_read_bandwidth(
    threads: int, size_bytes: int | None = None, repeats: int = 7, kernels: Kernels | None = None
) -> dict:
    """The memory's read speed with `threads`: each reader's median over `repeats` passes (the readers
    taking turns on one buffer, MemoryReader), and the faster of them."""
    with MemoryReader(threads, size_bytes, kernels) as reader:
        passes = [reader.speeds() for _ in range(repeats)]
    speeds = {name: statistics.median(speeds[name] for speeds in passes) for name in passes[0]}
    fastest = max(speeds, key=speeds.__getitem__)
    return {
        "threads": threads,
        "buffer_bytes": reader.size,
        "buffer_huge_page_bytes": reader.huge_page_bytes,  # of it, in 2 MiB pages
        "last_level_cache_bytes": reader.cache,
        "bytes_per_s": speeds[fastest],
        "reader": fastest,
        "readers_bytes_per_s": speeds,
        "repeats": repeats,
    }


def safetensors_index(model: Path) -> dict[str, tuple[str, int]]:
    """Tensor name -> (dtype, element count), from the checkpoint's safetensors headers (no weights read)."""
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            tensors[name] = (entry["dtype"], count)
    return tensors


def decode_bytes_per_token(model: Path, dtype: str, quantize: str = "none") -> int:
    """Bytes of weights one decode step reads at `dtype`: the language model without its input
    embedding table, plus the output head (the embedding's weights again when they are tied).
    At a quantize level the decoder's linear layers read their quantized bytes (scales included) and
    the head too, in int8 (vlserve/kernels/quantized.py)."""
    tensors = safetensors_index(model)
    config = json.loads((model / "config.json").read_text())
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    width = DTYPE_BYTES[dtype]
    total = 0
    linear = 0
    embedding = 0
    head = 0
    for name, (_, count) in tensors.items():
        if "language_model" not in name and not name.startswith("lm_head"):
            continue  # the vision tower runs once per image, not per token
        if name.endswith("embed_tokens.weight"):
            embedding = count
        elif name.startswith("lm_head"):
            head = count
        elif name.endswith("_proj.weight"):
            linear += count
        else:
            total += count
    head = head or (embedding if tied else 0)
    if quantize == "none":
        return (total + linear + head) * width
    head_bytes = head * QUANTIZED_BYTES_PER_32_WEIGHTS["int8"] // 32  # the head is int8 at both levels
    return total * width + linear * QUANTIZED_BYTES_PER_32_WEIGHTS[quantize] // 32 + head_bytes
