"""The CPU KV cache is mapped at startup (huge_pages.prefault), not on first use inside a forward pass."""

from __future__ import annotations

import os

import torch

from radixlm.runtime.mem_cache.huge_pages import huge_page_empty, prefault
from radixlm.runtime.mem_cache.memory_pool import KVCache


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_cache_is_resident_once_built() -> None:
    before = resident_bytes()
    kv = KVCache(16384, 1, 2, 4, 64, torch.bfloat16, "cpu")     # 4 buffers of 8 MiB
    grown = resident_bytes() - before
    assert grown >= 0.95 * 4 * 16385 * 4 * 64 * 2, grown
    assert all(int(b.abs().sum()) == 0 for b in kv.k_buffer + kv.v_buffer)   # still zeros


def test_prefault_keeps_zeros_and_maps_every_page() -> None:
    t = huge_page_empty(3 << 20, torch.uint8)                   # 3 MiB: a huge page and a half
    before = resident_bytes()
    prefault(t)
    assert resident_bytes() - before >= (3 << 20) - 4096
    assert int(t.sum()) == 0
