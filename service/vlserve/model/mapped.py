"""Pages of the checkpoint's memory map handed back once a tensor has been converted out of it.

The loader's tensors start as views of the safetensors files, mapped privately and never written;
what a level serves as it is stays there (packing.py), what it converts (packed, rounded, a prompt
copy) is made elsewhere. The map is unmapped only when its last tensor goes, so every page read stays
in the process's resident set beside its conversion: a worker that copied its weights peaked at
9.4 GB (4.3 GB of mapped file pages, 5.1 GB of copies) for 5.4 GB settled. Giving each source's pages
back (`madvise(MADV_DONTNEED)`) once its conversion is made keeps the peak near the settled figure.
The pages stay in the page cache (clean, shared with the host's other workers, the kernel's to
reclaim), and a view read again later only faults them back in: nothing is lost, since a private
file mapping that was never written holds exactly the file's bytes.

Only whole pages inside a `.safetensors` file's private mapping are handed back, so anonymous memory
(where MADV_DONTNEED would zero a tensor) is never touched.
"""

from __future__ import annotations

import mmap

import torch

from vlserve.model.pages import MADV_DONTNEED, madvise

PAGE = mmap.PAGESIZE


def checkpoint_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's private mappings of `.safetensors` files."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1][3] == "p" and fields[5].rstrip().endswith(".safetensors"):
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def release(*tensors: torch.Tensor | None) -> int:
    """Hand back the whole pages of each tensor's bytes that lie in a checkpoint mapping, once the
    tensor's contents have been copied elsewhere. Returns the bytes handed back (0 off Linux, for
    tensors in anonymous memory, or those smaller than a page)."""
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if t is not None and t.numel() and t.is_contiguous()
    ]
    if not spans:
        return 0
    ranges = checkpoint_ranges()
    released = 0
    for start, end in spans:
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if last <= first or not any(low <= first and last <= high for low, high in ranges):
            continue
        if madvise(first, last - first, MADV_DONTNEED):  # else (not expected) they stay until the map closes
            released += last - first
    return released
