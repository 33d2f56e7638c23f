"""Weight files held in the page cache as whole 2 MiB folios, whatever the cache held before.

Decode reads every weight once per step, straight from the files' memory maps, and how fast it reads
depends on how the kernel placed those pages. On a 2-vCPU Xeon VM (Linux 6.18, ext4), two copies of
the 3.1 GB int4 weight file mapped in one process read at 33-34.5 GB/s from 2 MiB folios and at
21.7-22.5 from scattered 4 KiB pages. Which one a worker got depended on the cache's history: a file
read in long sequential runs comes in 2 MiB folios, one faulted in by a loader's scattered accesses
mostly in small ones, and one partly evicted and faulted back fills its holes page by page.

So before a level's weight file is mapped, `settle` walks it through a mapping of its own, one
mapping per 2 MiB chunk at an aligned address, advised MADV_HUGEPAGE, touched in file order: a chunk
not cached yet is read as one 2 MiB folio (a cold start reads the file in order, faster than the
loader's faults), a chunk cached whole in such a folio is mapped by one page-table entry, and each
mapping's `FilePmdMapped` (/proc/self/smaps) tells which chunks are not. Those (an aged cache) are
read again after the worker is ready, a few per scheduler pass (`reread_steps`): this process's own
read-only mappings of them are dropped (the file keeps its bytes), the pages nobody maps are dropped
from the cache (posix_fadvise DONTNEED leaves those another worker maps) and read again the same way.
Doing it at load cost up to 1.6 s of start on a host whose memory was full of other files' pages
(2 MiB folios then take compaction). One chunk is tried first, so a kernel or filesystem that cannot
hold a file in 2 MiB folios (ext4 before Linux 6.16, tmpfs without huge=) costs one chunk's read.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Linux's values (asm-generic/mman-common.h, the same on x86-64 and aarch64): Python's mmap module lacks these.
PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MADV_RANDOM = 1
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14


def huge_page_bytes() -> int:
    """The kernel's PMD page size (2 MiB on x86-64 and 4 KiB-page arm64)."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


@dataclass(frozen=True)
class Settled:
    """What `settle` found of one file."""

    path: Path
    chunk: int  # bytes of a chunk: the PMD page size
    chunks: int  # whole chunks in the file (the tail under a chunk stays as it is)
    small: tuple[int, ...]  # the chunks not held in one 2 MiB folio
    seconds: float

    @property
    def settled(self) -> bool:
        return not self.small


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) on this process's memory; False where it failed (errno logged) or off Linux."""
    if _LIBC is None:
        return False
    if _LIBC.madvise(address, length, advice) == 0:
        return True
    log.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
    return False


def smaps_field(starts: list[int], field: str) -> dict[int, int]:
    """One /proc/self/smaps field (e.g. FilePmdMapped, AnonHugePages), in bytes, of the mappings that
    begin at these addresses (those it does not find are left out)."""
    wanted = {"%x" % start: start for start in starts}
    found, current = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            token = line.split(maxsplit=1)[0]
            if "-" in token and not token.endswith(":"):  # a mapping's header: "start-end perms ..."
                current = wanted.get(token.split("-", 1)[0])
            elif current is not None and line.startswith(field + ":"):
                found[current] = int(line.split()[1]) * 1024
                current = None
    return found


def anonymous_huge(nbytes: int) -> tuple[mmap.mmap, int, int]:
    """Private anonymous memory for `nbytes`, advised MADV_HUGEPAGE from a 2 MiB boundary: the mapping,
    the offset of that boundary in it, and its address. Written once, it sits in 2 MiB pages where the
    kernel's transparent huge pages allow (`enabled` set to madvise or always)."""
    chunk = huge_page_bytes()
    mapping = mmap.mmap(-1, nbytes + chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % chunk
    madvise(address + offset, nbytes, MADV_HUGEPAGE)
    return mapping, offset, address + offset


class _Probe:
    """A read-only shared mapping of each of these chunks of a file, at chunk-aligned addresses (so a
    chunk can be mapped by one page-table entry) with a gap between them (so the kernel keeps them as
    separate mappings and smaps reports each one's FilePmdMapped), advised MADV_HUGEPAGE."""

    def __init__(self, fd: int, indexes: list[int], chunk: int):
        self.chunk = chunk
        self.span = 2 * len(indexes) * chunk + chunk
        self.reserved = _LIBC.mmap(
            None, self.span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
        )
        if self.reserved in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap reserve")
        base = -(-self.reserved // chunk) * chunk
        self.addresses = {index: base + 2 * place * chunk for place, index in enumerate(indexes)}
        for index, at in self.addresses.items():
            if _LIBC.mmap(at, chunk, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, index * chunk) != at:
                error = ctypes.get_errno()
                self.close()
                raise OSError(error, "mmap")
            madvise(at, chunk, MADV_HUGEPAGE)  # a cold chunk is read as one 2 MiB folio

    def touch(self) -> None:
        for at in self.addresses.values():
            ctypes.c_char.from_address(at).value  # noqa: B018 - the read faults it in

    def small(self) -> list[int]:
        """The chunks not mapped as one 2 MiB folio (smaps' FilePmdMapped below the chunk's size)."""
        mapped = smaps_field(list(self.addresses.values()), "FilePmdMapped")
        return [index for index, at in self.addresses.items() if mapped.get(at, 0) < self.chunk]

    def close(self) -> None:
        _LIBC.munmap(self.reserved, self.span)


def _probed(path: Path, indexes: list[int] | None, before=None) -> tuple[int, int, list[int]] | None:
    """Map `indexes` (all chunks when None) through a probe, call `before(fd)` first if given, touch
    them in order: (chunk, chunks in the file, those still small); None where it cannot."""
    chunk = huge_page_bytes()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = os.fstat(fd).st_size // chunk
        indexes = list(range(chunks)) if indexes is None else indexes
        if _LIBC is None or not indexes:
            return None
        if before is not None:
            before(fd, chunk)
        try:
            probe = _Probe(fd, indexes, chunk)
        except OSError as error:
            log.debug("page cache: cannot map %s (%s)", path, error)
            return None
        try:
            probe.touch()
            return chunk, chunks, probe.small()
        finally:
            probe.close()
    finally:
        os.close(fd)


def settle(path: Path) -> Settled | None:
    """Read `path`'s uncached chunks into 2 MiB folios, in order, and find those the cache holds in
    small pages. None off Linux, for files under one chunk, or when the file cannot be mapped."""
    started = time.monotonic()
    found = _probed(path, None)
    if found is None:
        return None
    chunk, chunks, small = found
    return Settled(Path(path), chunk, chunks, tuple(small), time.monotonic() - started)


def _mapped_here(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of `path` that hold only the file's bytes:
    read-only ones, and private ones with no page written (safetensors maps its files private and
    writable; smaps' Anonymous counts the pages a write copied)."""
    target = str(Path(path).resolve())
    found, private = [], []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start, end = (int(value, 16) for value in fields[0].split("-"))
                if "w" not in fields[1]:
                    found.append((start, end, int(fields[2], 16)))
                elif fields[1][3] == "p":
                    private.append((start, end, int(fields[2], 16)))
    written = smaps_field([start for start, _, _ in private], "Anonymous") if private else {}
    return found + [mapping for mapping in private if written.get(mapping[0], 1) == 0]


def read_again(path: Path, indexes: list[int]) -> list[int]:
    """Drop these chunks' pages from this process's mappings of `path` that hold only its bytes and from
    the page cache (those another process maps stay), and read them again into 2 MiB folios: the chunks
    still small after. A view read later faults the file's bytes back in; nothing is lost."""

    def drop(fd: int, chunk: int) -> None:
        for start, end, offset in _mapped_here(path):
            for index in indexes:
                low, high = max(index * chunk, offset), min((index + 1) * chunk, offset + end - start)
                if low < high:
                    madvise(start + low - offset, high - low, MADV_DONTNEED)
        for index in indexes:
            os.posix_fadvise(fd, index * chunk, chunk, os.POSIX_FADV_DONTNEED)

    found = _probed(path, indexes, drop)
    return indexes if found is None else found[2]


CHUNKS_PER_STEP = 16  # 32 MiB read again per scheduler pass: 20-40 ms here


def reread_steps(settled: Settled) -> list[Callable[[], None]]:
    """The small chunks of a settled file read again a few at a time, in the order to run the steps.
    The first step tries one chunk: when it stays small, the kernel or filesystem cannot do better (or
    another process holds the pages) and the other steps do nothing."""
    if settled.settled:
        return []
    state = {"stop": False, "started": None}
    parts = [list(settled.small[:1])] + [
        list(settled.small[at : at + CHUNKS_PER_STEP]) for at in range(1, len(settled.small), CHUNKS_PER_STEP)
    ]

    def step(number: int, part: list[int]) -> None:
        if state["stop"]:
            return
        state["started"] = state["started"] or time.monotonic()
        left = read_again(settled.path, part)
        if number == 0 and left:
            state["stop"] = True
            log.info(
                "page cache: %d of %s's %d chunks stay in small pages: this kernel or filesystem does not give"
                " it 2 MiB folios, or another process maps them",
                len(settled.small),
                settled.path.name,
                settled.chunks,
            )
        elif number == len(parts) - 1:
            log.info(
                "page cache: %d MiB of %s read again into 2 MiB folios in %.1f s",
                len(settled.small) * settled.chunk >> 20,
                settled.path.name,
                time.monotonic() - state["started"],
            )

    return [functools.partial(step, number, part) for number, part in enumerate(parts)]


def settle_files(paths: list[Path]) -> list[Callable[[], None]]:
    """`settle` each file; the steps that read again what an aged cache holds in small pages."""
    steps = []
    for path in paths:
        result = settle(path)
        if result is None:
            continue
        if result.small:
            log.info(
                "page cache: %d of %s's %d chunks are in small pages (an aged cache): reading them again after ready",
                len(result.small),
                path.name,
                result.chunks,
            )
        steps += reread_steps(result)
    return steps
