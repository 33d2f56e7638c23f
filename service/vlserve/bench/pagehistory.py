"""Weight files put into a given page-cache history before a benchmark's turn: `bench-decode --cache-history`.

A worker's decode reads its weights straight from their files' memory maps, so how fast it reads can
depend on what the page cache did with those files before it started (vlserve/model/pages.py). Two
histories stand for the ends of what a host sees:

- `fresh`: the files dropped from the cache and read once in order, as right after a copy or a
  deploy: the kernel reads them in long runs (into 2 MiB folios where the filesystem allows).
- `aged`: the files dropped, other memory as large as them written and freed (another program's
  work, which leaves the memory the files had to others), then the files read back one 4 KiB page at
  a time in a scattered order with read-ahead off, as a loader's scattered faults or a cache that
  evicted and faulted pages back leaves them: every page its own small folio.

Each turn records how many of its files' 2 MiB chunks were not held in one folio right before its
load (`pages.settle`, which after a full read only maps and looks), so a report shows whether the
history took on this host: on tmpfs, whose pages cannot be dropped, both histories look alike.
"""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Iterable
from pathlib import Path

from vlserve.model import pages

HISTORIES = ("fresh", "aged")
PAGE = 4096
READ_BYTES = 64 * 2**20  # a fresh read's request size
SEED = 20261206  # the aged read's order: the same on every turn, so turns differ only by the host


def drop(path: Path) -> None:
    """Drop the file's pages that no process maps from the page cache (posix_fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_in_order(path: Path) -> None:
    with path.open("rb") as handle:
        while handle.read(READ_BYTES):
            pass


def read_scattered(path: Path, seed: int = SEED) -> None:
    """Read every 4 KiB page of the file once, in a shuffled order, read-ahead off (POSIX_FADV_RANDOM)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        offsets = list(range(0, os.fstat(fd).st_size, PAGE))
        random.Random(seed).shuffle(offsets)
        for offset in offsets:
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


def churn(nbytes: int) -> None:
    """Write `nbytes` of anonymous memory once, page by page, and free it: other work's memory."""
    if nbytes <= 0:
        return
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for offset in range(0, nbytes, PAGE):
            block[offset] = 1
    finally:
        block.close()


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where it does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prepare(paths: Iterable[Path], history: str) -> dict:
    """Put `paths` into `history` (one of HISTORIES): what it did and the chunks it left in small pages."""
    if history not in HISTORIES:
        raise ValueError("unknown cache history %r (one of %s)" % (history, ", ".join(HISTORIES)))
    files = [Path(path) for path in paths]
    for path in files:
        drop(path)
    if history == "fresh":
        for path in files:
            read_in_order(path)
    else:
        # as large as the files, within half of what the host has free: other work, not memory pressure
        churn(min(sum(path.stat().st_size for path in files), available_bytes() // 2) // PAGE * PAGE)
        for path in files:
            read_scattered(path)
    chunks = small = 0
    for path in files:
        found = pages.settle(path)
        if found is not None:
            chunks += found.chunks
            small += len(found.small)
    return {"history": history, "chunks": chunks, "small_chunks": small}
