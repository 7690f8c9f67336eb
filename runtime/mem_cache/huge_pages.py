"""CPU tensors backed by 2 MiB transparent huge pages, for memory that is streamed every step.

    huge_page_empty(numel, dtype)   # zeros, mapped on first touch
    prefault(tensor)                # map them all now (the KV cache, at startup)

A decode step reads every weight and, at large batch, every cached K/V row. On this project's VM a
sequential read of ordinary 4 KiB-page memory ran at about 27 GB/s and of 2 MiB-page memory at
50 GB/s: a TLB miss costs a two-level page walk in a guest. So the packed weights
(runtime/layers/packed_linear.py) and the CPU KV cache (memory_pool.KVCache) are allocated here.

Linux backs such a mapping with huge pages when /sys/kernel/mm/transparent_hugepage/enabled is
`always` or `madvise` (the usual default); otherwise it is ordinary memory and everything still works.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode: 'always', 'madvise', 'never' or 'unknown'."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1: text.find("]")] if "[" in text else "unknown"


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of zeros in its own anonymous mapping, 2 MiB aligned, that the kernel is
    asked (madvise) to back with huge pages. Pages are faulted in on first touch, as with
    torch.zeros. The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:   # e.g. a kernel built without THP
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    raw = torch.frombuffer(region, dtype=torch.uint8)   # holds a reference to `region`
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip: skip + nbytes].view(dtype)


def prefault(t: torch.Tensor) -> None:
    """Touches every 4 KiB page of `t` (a huge_page_empty tensor; its zeros stay zeros) so that the
    kernel maps it now rather than on first use. On this project's VMs a first touch of a 2 MiB page
    took 0.4-6 ms: the KV cache's first use in a serving burst paid that inside the forward pass (a
    2,048-token prefill of SmolLM2 writes 47 MB of K/V; its writes took 400 ms instead of 17 ms)."""
    flat = t.view(-1).view(torch.uint8)
    flat[::4096].zero_()
