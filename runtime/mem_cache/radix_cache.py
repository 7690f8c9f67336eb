"""RadixAttention prefix cache: a radix tree from token-id sequences to KV slot indices.

Each edge (node) holds a run of token ids (`key`) and the KV slots of those tokens (`value`).
With `page_size > 1`, every key length is a multiple of the page size, children are keyed by their
first page, and keys are compared page by page, so a node never ends inside a KV page.

Sizes: every cached token is either evictable (its node has `lock_ref == 0`) or protected.
Locks propagate: `inc_lock_ref(node)` locks the whole path from `node` to the root, so an unlocked
node never has a locked descendant and eviction only has to look at unlocked leaves.

KV events (`events`, a KVEventRecorder; kv_events.py): a new leaf is announced as BlockStored, an
evicted leaf as BlockRemoved, `reset` as AllBlocksCleared. Each node then keeps the hash of every
page of its key (`block_hashes`), split along with the node.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import torch

from ..utils import align_down
from .base_cache import BasePrefixCache, InsertResult, MatchResult, PeekResult
from .kv_events import KVEventRecorder, chain_hashes
from .tree_node import TreeNode


class RadixCache(BasePrefixCache):
    """Prefix cache over paged KV. See `BasePrefixCache` for the ownership and locking contract."""

    def __init__(self, page_size: int, device: str | torch.device = "cpu", events: KVEventRecorder | None = None):
        self.page_size = page_size
        self.device = device
        self.events = events
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], self._empty(), None)
        self.root.lock_ref = 1               # never evictable, never counted
        self._evictable_size = 0
        self._protected_size = 0
        if self.events is not None:
            self.events.cleared()

    # ----------------------------------------------------------- matching and inserting
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`; splits the node the match ends inside.

        Refreshes the access time of every node on the matched path. Does not lock: the returned
        indices are valid only while `last_node` is locked (or until the next `evict`/`reset`).
        """
        key = list(key[: align_down(len(key), self.page_size)])
        node, values = self.root, []
        node.touch()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.touch()
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        kv_indices = torch.cat(values) if values else self._empty()
        return MatchResult(kv_indices, node)

    def peek_prefix(self, key: list[int]) -> PeekResult:
        """The length `match_prefix(key)` would return and where it would end, changing nothing."""
        key = key[: align_down(len(key), self.page_size)]
        node, done = self.root, 0
        while done < len(key):
            child = node.children.get(self._child_key(key[done:]))
            if child is None:
                break
            n = self._match_len(child.key, key[done:])
            done += n
            if n < len(child.key):
                return PeekResult(done, child, n)
            node = child
        return PeekResult(done, node, len(node.key))

    def insert(self, key: list[int], value: torch.Tensor) -> InsertResult:
        """Cache `value[i]` as the slot of `key[:i+1]`; the whole key is cached afterwards.

        `len(key)` must be a multiple of `page_size`. Slots `value[:prefix_len]` are duplicates that
        the tree does not take: the caller frees those it owns. `value[prefix_len:]` now belong to the
        tree (in new, unlocked, evictable nodes). Splits a node when `key` ends inside it.
        """
        assert len(key) % self.page_size == 0, "insert needs a page-aligned key"
        assert len(key) == len(value), "key and value lengths differ"
        key, value = list(key), value.to(torch.int64)
        node, done = self.root, 0
        node.touch()
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                self._add_leaf(node, rest, value[done:])
                break
            child.touch()
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            node, done = child, done + n
        return InsertResult(done, len(key))

    # ----------------------------------------------------------- locking
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock `node` and its ancestors: their tokens move from evictable to protected on first lock."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Undo one `inc_lock_ref(node)`: tokens move back to evictable when the last lock goes."""
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ----------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove least-recently-used unlocked leaves until `num_tokens` are out or none are left.

        Returns the removed slots (the caller frees them). A parent whose last child goes, and which
        is unlocked, becomes a candidate itself.
        """
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            leaf = heapq.heappop(heap)
            evicted.append(leaf.value)
            count += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return torch.cat(evicted) if evicted else self._empty()

    # ----------------------------------------------------------- sizes and debugging
    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def all_values(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is not self.root:
                key = node.key if len(node.key) <= 12 else [*node.key[:12], "..."]
                lines.append(f"{'  ' * depth}{key} len={len(node.key)} lock={node.lock_ref} "
                             f"slots={node.value[:4].tolist()}{'...' if len(node.value) > 4 else ''}")
            stack.extend((c, depth + 1) for c in node.children.values())
        lines.append(f"total={self.total_size()} evictable={self._evictable_size} "
                     f"protected={self._protected_size}")
        text = "\n".join(lines)
        print(text)
        return text

    # ----------------------------------------------------------- helpers
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: list[int]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of `a` and `b`, in whole pages."""
        n, P = min(len(a), len(b)), self.page_size
        i = 0
        if P == 1:
            while i < n and a[i] == b[i]:
                i += 1
            return i
        while i + P <= n and a[i:i + P] == b[i:i + P]:
            i += P
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; returns the new upper node (same lock state and access time)."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        if child.block_hashes:
            pages = n // self.page_size
            upper.block_hashes, child.block_hashes = child.block_hashes[:pages], child.block_hashes[pages:]
        upper.children[self._child_key(child.key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        leaf = TreeNode(list(key), value.clone(), parent)
        parent.children[self._child_key(key)] = leaf
        self._evictable_size += len(key)
        if self.events is not None:
            parent_hash = parent.block_hashes[-1] if parent.block_hashes else None
            leaf.block_hashes = chain_hashes(parent_hash, leaf.key, self.page_size)
            self.events.stored(parent_hash, leaf.block_hashes, leaf.key)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._child_key(leaf.key)]
        self._evictable_size -= len(leaf.key)
        if self.events is not None:
            self.events.removed(leaf.block_hashes)
        return parent

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
