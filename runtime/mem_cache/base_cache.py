"""The prefix-cache interface the scheduler talks to, implemented by RadixCache and ChunkCache.

Ownership of KV slots, in one place:

- A slot is owned either by the cache (it sits in the tree) or by one request (it sits in that
  request's `req_to_token` row at or after `len(req.prefix_indices)`), or it is free in the allocator.
- A request that matched a prefix holds a lock on `req.last_node`; while it holds it, the slots of
  `req.prefix_indices` cannot be evicted. The request must not free them itself.
- `cache_finished_req` / `cache_unfinished_req` hand a request's slots over to the cache, free the
  duplicates, and move or drop the lock. After `cache_finished_req` the request owns nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.runtime.mem_cache.radix_cache import TreeNode


class MatchResult(NamedTuple):
    """Result of `match_prefix`.

    `kv_indices`: int64 slots of the matched prefix, one per token. `last_node`: the node where the
    match ends (the root when nothing matched); lock it to keep `kv_indices` valid.
    """

    kv_indices: torch.Tensor
    last_node: TreeNode


class CacheReq(Protocol):
    """The attributes of a scheduler request that the caches read and write."""

    req_pool_idx: int | None       # row in req_to_token_pool.req_to_token
    all_ids: list[int]             # prompt + output token ids
    cached_len: int                # tokens at the front of the row whose KV slots are held
    prefix_indices: torch.Tensor   # slots of the tree-owned prefix (len == prefix length)
    last_node: TreeNode | None     # node this request has locked


class BasePrefixCache(ABC):
    """Maps token-id prefixes to KV slots. Only the scheduler loop touches it (not thread-safe)."""

    page_size: int

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key` (page-aligned). Does not lock.

        May split a tree node and refreshes LRU times, but never frees or moves slots. The returned
        indices stay valid only while `last_node` is locked (or until the next `evict`/`reset`).
        """

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock `node` and every ancestor against eviction. None is a no-op."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one `inc_lock_ref(node)`. None is a no-op."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq) -> None:
        """The request is done (finished, aborted or retracted): give its KV to the cache, free the rest.

        Frees the request's row and unlocks `req.last_node`. Afterwards the request owns no slot and
        no row: `req_pool_idx` and `last_node` are None, `prefix_indices` is empty. Calling it again,
        or on a request that never got a row, frees nothing (it only drops a lock still held).
        """

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """The request keeps running (chunked prefill): share its KV so far and keep it locked.

        Rewrites the front of the request's row to the cache's slots and updates
        `req.prefix_indices` / `req.last_node`. Slots past the new prefix stay owned by the request.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached tokens if possible; returns how many were freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no request has locked (reclaimable by `evict`)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by at least one request."""

    @abstractmethod
    def total_size(self) -> int:
        """All cached tokens, counted by walking the cache (debug/tests; O(cache size))."""

    @abstractmethod
    def all_values(self) -> torch.Tensor:
        """Every slot the cache holds, int64 (for leak checks)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything without freeing slots; the caller clears the pools alongside."""

    @abstractmethod
    def pretty_print(self) -> str:
        """A readable dump of the cache for debugging (also printed)."""
