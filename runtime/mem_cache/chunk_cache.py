"""The no-sharing cache used with `--disable-radix-cache`: every request keeps its own KV slots.

It has the `BasePrefixCache` interface so the scheduler needs no special cases: nothing ever
matches, nothing is evictable, and a request's slots are freed as soon as it finishes. Chunked
prefill still works: between chunks the request's own slots serve as its "prefix".
"""

from __future__ import annotations

import torch

from radixlm.runtime.mem_cache.base_cache import BasePrefixCache, CacheReq, MatchResult
from radixlm.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.mem_cache.radix_cache import TreeNode


class ChunkCache(BasePrefixCache):
    """Caches nothing; see `BasePrefixCache` for the contract of each method."""

    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: TokenToKVPoolAllocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device
        self.root = TreeNode([], self._empty(), None)   # the `last_node` of every match

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Always an empty match ending at the (empty) root. No side effects."""
        return MatchResult(self._empty(), self.root)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """No-op: nothing is shared, so nothing needs protecting."""

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """No-op."""

    def cache_finished_req(self, req: CacheReq) -> None:
        """Free the request's slots [0, cached_len) and its row; the request owns nothing afterwards.

        Idempotent: a request without a row is left as is.
        """
        row = req.req_pool_idx
        if row is not None:
            slots = self.req_to_token_pool.req_to_token[row, : req.cached_len]
            self.token_to_kv_pool_allocator.free(slots.to(torch.int64))
            self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = self._empty()

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Keep every slot with the request: `prefix_indices` becomes its row's [0, cached_len)."""
        row = req.req_pool_idx
        assert row is not None, "cache_unfinished_req on a request without a row"
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : req.cached_len].to(torch.int64)
        req.last_node = self.root

    def evict(self, num_tokens: int) -> int:
        """Nothing is evictable; returns 0."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_values(self) -> torch.Tensor:
        return self._empty()

    def reset(self) -> None:
        """Nothing to forget."""

    def pretty_print(self) -> str:
        text = "ChunkCache (radix cache disabled): empty"
        print(text)
        return text

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
