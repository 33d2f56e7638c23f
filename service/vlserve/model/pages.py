"""Weight files held in the page cache as whole 2 MiB folios, whatever the cache held before.

Decode reads every weight once per step, straight from the files' memory maps, and how fast it reads
depends on how the kernel placed those pages. Measured on a 2-vCPU Xeon VM (kernel 6.18, ext4), the
same mapped 3.1 GB int4 weight file read at 27-33 GB/s when its pages sat in 2 MiB folios and at
22-23 GB/s when they sat in scattered 4 KiB pages, and int4 decode took 49-54 ms against 57-64 ms
a token. Which one a worker gets depended on the cache's history: a file read in long sequential
runs comes in 2 MiB folios, one faulted in by a loader's scattered accesses mostly in small ones, and
one partly evicted and faulted back fills its holes page by page.

So before a level's weight file is mapped, `settle` walks it through a mapping of its own, 2 MiB
aligned and advised MADV_HUGEPAGE, one touch per 2 MiB in file order: a chunk not cached yet is read
as one 2 MiB folio (a cold start reads the file in order, faster than the loader's faults), a chunk
cached whole in such a folio is mapped by one page-table entry, and the mapping's `FilePmdMapped`
(/proc/self/smaps) then counts what is settled. When much is not (an aged cache), the unmapped pages
of the file are dropped (posix_fadvise DONTNEED, which leaves pages another process maps) and read
again the same way, once. One chunk is tried first, so a kernel or filesystem that cannot hold a
file's pages in 2 MiB folios (ext4 before Linux 6.16, tmpfs without huge=) costs one chunk's read,
not a whole file's, at every start.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Linux's values (asm-generic/mman-common.h, the same on x86-64 and aarch64): Python's mmap module lacks these.
PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
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
    """What `settle` found and did for one file."""

    path: Path
    chunks_bytes: int  # the whole 2 MiB chunks of the file, the part that can be held in 2 MiB folios
    large_before: int  # of those, bytes already in 2 MiB folios (or read into them cold)
    large_after: int
    reread_bytes: int  # bytes dropped from the cache and read again
    seconds: float

    @property
    def settled(self) -> bool:
        return self.large_after == self.chunks_bytes


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
            head = line.split("-", 1)[0]
            if head in wanted:
                current = wanted[head]
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
    """A read-only shared mapping of each of a file's whole chunks, at chunk-aligned addresses (so a
    chunk can be mapped by one page-table entry) with a gap between them (so the kernel keeps them as
    separate mappings and smaps reports each one's FilePmdMapped), advised MADV_HUGEPAGE."""

    def __init__(self, fd: int, chunks: int, chunk: int):
        self.chunks, self.chunk = chunks, chunk
        self.span = 2 * chunks * chunk + chunk
        self.reserved = _LIBC.mmap(
            None, self.span, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
        )
        if self.reserved in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap reserve")
        self.base = -(-self.reserved // chunk) * chunk
        for index in range(chunks):
            at = self.address(index)
            if _LIBC.mmap(at, chunk, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, index * chunk) != at:
                error = ctypes.get_errno()
                self.close()
                raise OSError(error, "mmap")
            madvise(at, chunk, MADV_HUGEPAGE)  # a cold chunk is read as one 2 MiB folio

    def address(self, index: int) -> int:
        return self.base + 2 * index * self.chunk

    def touch(self, indexes) -> None:
        for index in indexes:
            ctypes.c_char.from_address(self.address(index)).value  # noqa: B018 - the read faults it in

    def unmap_pages(self, indexes) -> None:
        """Drop these chunks' page-table entries (a shared read-only file map: the file keeps its bytes)."""
        for index in indexes:
            madvise(self.address(index), self.chunk, MADV_DONTNEED)

    def small(self) -> list[int]:
        """The chunks not mapped as one 2 MiB folio (smaps' FilePmdMapped below the chunk's size)."""
        mapped = smaps_field([self.address(index) for index in range(self.chunks)], "FilePmdMapped")
        return [index for index in range(self.chunks) if mapped.get(self.address(index), 0) < self.chunk]

    def close(self) -> None:
        _LIBC.munmap(self.reserved, self.span)


def settle(path: Path) -> Settled | None:
    """Hold `path`'s whole chunks in the page cache as 2 MiB folios, reading again (once) what an aged
    cache holds in small pages. None off Linux, for files under one chunk, or when the file cannot be
    mapped (it is then loaded as before)."""
    chunk = huge_page_bytes()
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = os.fstat(fd).st_size // chunk
        if _LIBC is None or chunks == 0:
            return None
        try:
            probe = _Probe(fd, chunks, chunk)
        except OSError as error:
            log.debug("page cache: cannot map %s (%s)", path, error)
            return None
        try:
            probe.touch(range(chunks))
            small = probe.small()
            reread = _read_again(fd, probe, small) if small else []
            after = probe.small() if reread else small
        finally:
            probe.close()
    finally:
        os.close(fd)
    return Settled(
        Path(path),
        chunks * chunk,
        (chunks - len(small)) * chunk,
        (chunks - len(after)) * chunk,
        len(reread) * chunk,
        time.monotonic() - started,
    )


def _read_again(fd: int, probe: _Probe, small: list[int]) -> list[int]:
    """Drop the small chunks' pages that nobody maps and read them again, one chunk first: if that one
    does not come back as a 2 MiB folio, neither would the rest (or another process holds them), so
    they are left alone. Returns the chunks read again."""
    trial, rest = small[-1:], small[:-1]  # the last: the header's chunk may be held by a reader already
    for part in (trial, rest):
        probe.unmap_pages(part)
        for index in part:
            os.posix_fadvise(fd, index * probe.chunk, probe.chunk, os.POSIX_FADV_DONTNEED)
        probe.touch(part)
        if part is trial and trial[0] in probe.small():
            return trial
    return small


def settle_files(paths: list[Path]) -> list[Settled]:
    """`settle` each file, logging what it found and did."""
    done = []
    for path in paths:
        result = settle(path)
        if result is None:
            continue
        done.append(result)
        mib = 2**20
        if result.reread_bytes and result.settled:
            log.info(
                "page cache: %d of %s's %d MiB were in small pages (an aged cache): read again into 2 MiB folios"
                " in %.1f s",
                result.reread_bytes // mib,
                path.name,
                result.chunks_bytes // mib,
                result.seconds,
            )
        elif not result.settled:
            log.info(
                "page cache: %s stays in small pages (%d of %d MiB in 2 MiB folios): this kernel or filesystem "
                "does not give it large folios, or another process maps them",
                path.name,
                result.large_after // mib,
                result.chunks_bytes // mib,
            )
        else:
            log.debug("page cache: %s in 2 MiB folios (%.2f s)", path.name, result.seconds)
    return done
