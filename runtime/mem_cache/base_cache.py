"""The prefix-cache interface, implemented by RadixCache and ChunkCache (radix cache disabled).

A prefix cache maps token-id prefixes to KV slots. It never allocates or frees slots and never
touches the req->token table: `KVManager` does both. What the cache promises:

- Ownership. `insert` hands slots to the cache; `evict` hands them back (the caller frees them).
  A slot is never held by the cache and free in the allocator at once.
- Locking. `inc_lock_ref(node)` protects `node` and all its ancestors from `evict` until the
  matching `dec_lock_ref(node)`. Locks nest (they are counts).
- Validity. The indices returned by `match_prefix` stay valid while their `last_node` is locked;
  unlocked, they are valid only until the next `evict` or `reset`.

Only the scheduler loop touches a cache (not thread-safe).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .tree_node import TreeNode


class MatchResult(NamedTuple):
    """Result of `match_prefix`.

    `kv_indices`: int64 slots of the matched prefix, one per token. `last_node`: the node where the
    match ends (the root when nothing matched); lock it to keep `kv_indices` valid.
    """

    kv_indices: torch.Tensor
    last_node: TreeNode


class PeekResult(NamedTuple):
    """Result of `peek_prefix`: `length` tokens match; the match ends `node_len` tokens into `node`
    (`node_len == len(node.key)` when it ends at the node's end; the root and 0 when nothing matched)."""

    length: int
    node: TreeNode
    node_len: int


class InsertResult(NamedTuple):
    """Result of `insert(key, value)`.

    `prefix_len`: leading tokens the cache already held; `value[:prefix_len]` stay with the caller
    (duplicates to free). `cached_len`: leading tokens the cache holds after the call; the cache took
    `value[prefix_len:cached_len]`, and `value[cached_len:]` stay with the caller.
    """

    prefix_len: int
    cached_len: int


class BasePrefixCache(ABC):
    """Maps token-id prefixes to KV slots; see the module docstring for the contract."""

    page_size: int
    root: TreeNode

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`. Does not lock.

        May split a tree node and refreshes LRU times, but never takes, frees or moves slots.
        """

    @abstractmethod
    def peek_prefix(self, key: list[int]) -> PeekResult:
        """How far `key` matches (page-aligned), for ordering the waiting queue. Reads only: splits
        no node, refreshes no access time, returns no slots."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> InsertResult:
        """Offer `value[i]` as the slot of `key[:i+1]` (`len(key)` a multiple of `page_size`).

        Never frees: the caller frees what the result says the cache did not take. New nodes are
        unlocked (evictable).
        """

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock `node` and every ancestor against eviction. None is a no-op."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one `inc_lock_ref(node)`. None is a no-op."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove at least `num_tokens` unlocked cached tokens (fewer if fewer are evictable).

        Returns the removed int64 slots, which now belong to the caller (it must free them).
        Locked nodes are never evicted; `evict(0)` does nothing.
        """

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
        """Forget everything without returning slots; the caller clears the allocator alongside."""

    @abstractmethod
    def pretty_print(self) -> str:
        """A readable dump of the cache for debugging (also printed)."""
