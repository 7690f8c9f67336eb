"""The no-sharing cache used with `--disable-radix-cache`: every request keeps its own KV slots.

It has the `BasePrefixCache` interface so the KV manager and the scheduler need no special cases:
nothing ever matches, `insert` takes nothing (so a finished request's slots are all freed and a
chunked prefill keeps its own), and nothing is evictable.
"""

from __future__ import annotations

import torch

from .base_cache import BasePrefixCache, InsertResult, MatchResult, PeekResult
from .tree_node import TreeNode


class ChunkCache(BasePrefixCache):
    """Caches nothing; see `BasePrefixCache` for the contract of each method."""

    def __init__(self, page_size: int, device: str | torch.device = "cpu"):
        self.page_size = page_size
        self.device = device
        self.root = TreeNode([], self._empty(), None)   # the `last_node` of every match

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Always an empty match ending at the (empty) root. No side effects."""
        return MatchResult(self._empty(), self.root)

    def peek_prefix(self, key: list[int]) -> PeekResult:
        """Always nothing, at the root."""
        return PeekResult(0, self.root, 0)

    def insert(self, key: list[int], value: torch.Tensor) -> InsertResult:
        """Takes nothing: every slot stays with the caller."""
        return InsertResult(0, 0)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """No-op: nothing is shared, so nothing needs protecting."""

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """No-op."""

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Nothing is evictable; returns no slots."""
        return self._empty()

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
