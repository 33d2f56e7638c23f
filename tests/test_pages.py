"""The page cache's form of the weight files: found at load, what an aged cache holds in small pages
read again into 2 MiB folios after ready where the kernel can, and never churned where it cannot."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        offsets = list(range(0, os.fstat(fd).st_size, 4096))
        random.Random(1).shuffle(offsets)
        for offset in offsets:
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


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
