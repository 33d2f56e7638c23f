"""The page cache's form of the weight files: found at load, what an aged cache holds in small pages
read again into 2 MiB folios after ready where the kernel can, and never churned where it cannot."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlserve.bench import pagehistory
from vlserve.model import pages

CHUNK = pages.huge_page_bytes()
CHUNKS = 6


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A file of whole chunks plus a tail, written and synced (dirty pages cannot be dropped)."""
    path = tmp_path / "weights.safetensors"
    with path.open("wb") as file:
        file.write(os.urandom(CHUNKS * CHUNK + 12345))
        file.flush()
        os.fsync(file.fileno())
    return path


def in_small_pages(path: Path) -> None:
    """Drop the file's cached pages, then read it back one 4 KiB page at a time in random order with no
    readahead: each page comes in its own folio, as an aged cache's refaulted holes do."""
    pagehistory.drop(path)
    pagehistory.read_scattered(path)


def resident_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file), by mincore(2) over a mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    size = path.stat().st_size
    count = -(-size // mmap.PAGESIZE)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapping:
        vector = ctypes.create_string_buffer(count)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        assert libc.mincore(address, size, vector) == 0, ctypes.get_errno()
        return sum(byte & 1 for byte in vector.raw), count


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` is on (/proc/self/mounts: the longest mount point above it)."""
    found, length = "", -1
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point, kind = line.split()[1], line.split()[2]
        if (str(path).startswith(point.rstrip("/") + "/") or str(path) == point) and len(point) > length:
            found, length = kind, len(point)
    return found


def run(steps) -> None:
    for step in steps:
        step()


def capable(path: Path) -> bool:
    """Whether this kernel and filesystem hold the file in 2 MiB folios, by the code's own account: a
    cold file settled, or its small chunks read again and settled after."""
    run(pages.settle_files([path]))
    return pages.settle(path).settled


def test_a_settled_file_has_nothing_to_read_again(weights: Path) -> None:
    first = pages.settle(weights)
    assert first is not None and first.chunks == CHUNKS  # the tail under a chunk is left out
    second = pages.settle(weights)
    assert second.small == first.small
    assert (pages.reread_steps(second) == []) == second.settled


def test_small_pages_are_read_again_into_2mib_folios_where_the_kernel_can(weights: Path) -> None:
    can = capable(weights)
    # Private and writable but never written, as safetensors maps its files.
    with weights.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as own:
        in_small_pages(weights)
        for offset in range(0, len(own), 4096):
            own[offset]  # this process maps them too, as the worker does its weights
        found = pages.settle(weights)
        assert found.small == tuple(range(CHUNKS))
        steps = pages.reread_steps(found)
        assert len(steps) == 1 + -(-(CHUNKS - 1) // pages.CHUNKS_PER_STEP)  # a trial chunk, then the rest
        run(steps)
        after = pages.settle(weights)
        assert after.settled == can
        if not can:  # one trial chunk read again, the rest left alone
            assert after.small == found.small
        assert own[: 2 * CHUNK] == weights.read_bytes()[: 2 * CHUNK]  # the mapping still reads the file


def test_a_mapping_with_a_written_page_keeps_it(weights: Path) -> None:
    """A private mapping a write has touched holds a page of its own, which dropping would lose: such a
    mapping is left alone, so its chunks stay as they are and the write stays."""
    original = weights.read_bytes()[:8]
    with weights.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as own:
        in_small_pages(weights)
        for offset in range(0, len(own), 4096):
            own[offset]
        own[:8] = b"written!"
        found = pages.settle(weights)
        run(pages.reread_steps(found))
        assert own[:8] == b"written!"
        assert pages.settle(weights).small == found.small  # pinned by this mapping: nothing read again
    assert weights.read_bytes()[:8] == original


def test_pages_another_process_maps_are_left_in_place(weights: Path) -> None:
    """posix_fadvise(DONTNEED) cannot drop pages another process maps: the trial chunk comes back small
    and the other steps do nothing."""
    if not capable(weights):
        pytest.skip("no 2 MiB folios for this file here: the trial-chunk path is covered above")
    in_small_pages(weights)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys\n"
            "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "[m[o] for o in range(0, len(m), 4096)]\n"
            "print('held', flush=True); sys.stdin.read()",
            str(weights),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        found = pages.settle(weights)
        assert found.small == tuple(range(CHUNKS))
        run(pages.reread_steps(found))
        assert pages.settle(weights).small == found.small
    finally:
        holder.communicate("", timeout=30)


def test_files_it_cannot_settle_are_passed_over(tmp_path: Path) -> None:
    small = tmp_path / "small.safetensors"
    small.write_bytes(b"\0" * 4096)
    assert pages.settle(small) is None
    assert pages.settle(tmp_path / "missing.safetensors") is None
    assert pages.settle_files([small, tmp_path / "missing.safetensors"]) == []


def test_the_benchmarks_cache_histories_drop_the_file_and_read_it_back_in_order_or_in_small_pages(
    weights: Path,
) -> None:
    """`bench-decode --cache-history`: aged leaves every chunk in small pages, fresh the file read in
    order; both leave all of it cached, and say how many chunks were small."""
    if filesystem(weights) == "tmpfs":
        pytest.skip("tmpfs keeps its pages: no history can be made there")
    pagehistory.drop(weights)
    assert resident_pages(weights)[0] == 0
    aged = pagehistory.prepare([weights], "aged")
    assert aged == {"history": "aged", "chunks": CHUNKS, "small_chunks": CHUNKS}
    cached, count = resident_pages(weights)
    assert cached == count
    fresh = pagehistory.prepare([weights], "fresh")
    assert fresh["history"] == "fresh" and fresh["chunks"] == CHUNKS
    assert fresh["small_chunks"] == len(pages.settle(weights).small)  # settle only looks at a cached file
    cached, count = resident_pages(weights)
    assert cached == count
    with pytest.raises(ValueError, match="unknown cache history 'warm'"):
        pagehistory.prepare([weights], "warm")
