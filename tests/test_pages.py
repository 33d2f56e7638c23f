"""The page cache's form of the weight files: settled into 2 MiB folios where the kernel can, read again
once when an aged cache holds them in small pages, and never churned where it cannot."""

from __future__ import annotations

import os
import random
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
        pages = list(range(0, os.fstat(fd).st_size, 4096))
        random.Random(1).shuffle(pages)
        for offset in pages:
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


def test_a_settled_file_is_not_read_again(weights: Path) -> None:
    first = pages.settle(weights)
    assert first is not None
    assert first.chunks_bytes == CHUNKS * CHUNK  # the tail under a chunk is left out
    second = pages.settle(weights)
    assert second.large_before == second.large_after == first.large_after
    if first.settled:
        assert second.settled and second.reread_bytes == 0
    else:  # a kernel or filesystem without 2 MiB folios here: one trial chunk per call, never the file
        assert second.reread_bytes == CHUNK


def test_small_pages_are_read_again_into_2mib_folios_where_the_kernel_can(weights: Path) -> None:
    capable = pages.settle(weights).settled
    in_small_pages(weights)
    result = pages.settle(weights)
    if capable:
        assert result.large_before < result.chunks_bytes  # the small pages were seen
        assert result.reread_bytes == result.chunks_bytes - result.large_before
        assert result.settled
    else:
        assert result.reread_bytes == CHUNK and not result.settled
    assert weights.read_bytes()[:16]  # the file is intact either way


def test_pages_another_mapping_holds_are_left_in_place(weights: Path) -> None:
    """posix_fadvise(DONTNEED) cannot drop mapped pages: with the whole file mapped elsewhere in small
    pages, settling reads one trial chunk, sees it come back small, and stops."""
    import mmap  # noqa: PLC0415

    if not pages.settle(weights).settled:
        pytest.skip("no 2 MiB folios for this file here: the trial-chunk path is covered above")
    in_small_pages(weights)
    with weights.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as held:
        for offset in range(0, len(held), 4096):
            held[offset]  # map every page here, as another worker's process would
        result = pages.settle(weights)
    assert result.large_before == 0
    assert result.reread_bytes == CHUNK and not result.settled


def test_files_it_cannot_settle_are_passed_over(tmp_path: Path) -> None:
    small = tmp_path / "small.safetensors"
    small.write_bytes(b"\0" * 4096)
    assert pages.settle(small) is None
    assert pages.settle(tmp_path / "missing.safetensors") is None
    assert pages.settle_files([small, tmp_path / "missing.safetensors"]) == []
