"""RadixAttention prefix cache: a radix tree from token-id sequences to KV slot indices.

Each edge (node) holds a run of token ids (`key`) and the KV slots of those tokens (`value`).
With `page_size > 1`, every key length is a multiple of the page size, children are keyed by their
first page, and keys are compared page by page, so a node never ends inside a KV page.

Sizes: every cached token is either evictable (its node has `lock_ref == 0`) or protected.
Locks propagate: `inc_lock_ref(node)` locks the whole path from `node` to the root, so an unlocked
node never has a locked descendant and eviction only has to look at unlocked leaves.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import torch

from radixlm.runtime.mem_cache.base_cache import BasePrefixCache, CacheReq, MatchResult
from radixlm.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

_access_clock = itertools.count()   # monotonic, deterministic LRU timestamps


class TreeNode:
    """One edge of the radix tree. The root has an empty key and is never evicted."""

    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None):
        self.id = next(TreeNode._ids)
        self.key = key                       # token ids on this edge
        self.value = value                   # int64 KV slots, len(value) == len(key)
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0                    # number of requests holding this node or a descendant
        self.last_access = next(_access_clock)

    def touch(self) -> None:
        self.last_access = next(_access_clock)

    def __lt__(self, other: TreeNode) -> bool:       # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache):
    """Prefix cache over paged KV. See `BasePrefixCache` for the ownership and locking contract."""

    def __init__(self, req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: TokenToKVPoolAllocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], self._empty(), None)
        self.root.lock_ref = 1               # never evictable, never counted
        self._evictable_size = 0
        self._protected_size = 0

    # ----------------------------------------------------------- matching and inserting
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`; splits the node the match ends inside.

        Refreshes the access time of every node on the matched path. Does not lock: the returned
        indices are valid only while `last_node` is locked (or until the next `evict`/`reset`).
        """
        key = list(key[: len(key) // self.page_size * self.page_size])
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

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `value[i]` as the slot of `key[:i+1]`; returns how many leading tokens were already cached.

        `len(key)` must be a multiple of `page_size`. Slots `value[:returned_len]` are duplicates that
        the tree does not take: the caller frees those it owns. `value[returned_len:]` now belong to the
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
        return done

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
    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-used unlocked leaves until `num_tokens` are freed or none are left.

        Frees the evicted slots through the allocator and returns how many tokens were freed. A parent
        whose last child goes, and which is unlocked, becomes a candidate itself.
        """
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.token_to_kv_pool_allocator.free(leaf.value)
            freed += len(leaf.key)
            parent = self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    # ----------------------------------------------------------- request-level helpers
    def cache_finished_req(self, req: CacheReq) -> None:
        """Insert the request's KV into the tree, free its duplicates, tail, lock and row.

        Region table of the request's row, P = page_size:
          [0, prefix_len)             tree-owned prefix (req.prefix_indices), locked by req.last_node
          [prefix_len, already_len)   request's copies of tokens the tree already had   -> freed
          [already_len, aligned_len)  new to the tree                                    -> tree
          [aligned_len, cached_len)   partial last page, not cacheable                   -> freed
        Idempotent: a request without a row (never admitted, or already cached) only drops its lock.
        """
        row, cached_len = req.req_pool_idx, req.cached_len
        if row is not None:
            self._insert_and_free_row(req, row, cached_len)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = self._empty()

    def _insert_and_free_row(self, req: CacheReq, row: int, cached_len: int) -> None:
        """The row part of `cache_finished_req` (region table above); leaves the lock alone."""
        slots = self.req_to_token_pool.req_to_token[row, :cached_len].to(torch.int64)
        aligned_len = cached_len // self.page_size * self.page_size
        prefix_len = len(req.prefix_indices)
        already_len = self.insert(req.all_ids[:aligned_len], slots[:aligned_len])
        self.token_to_kv_pool_allocator.free(slots[prefix_len:already_len])
        self.token_to_kv_pool_allocator.free(slots[aligned_len:])
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Insert the request's KV so far, free duplicates, and re-lock the request on the longer prefix.

        Same region table as `cache_finished_req`, except that [aligned_len, cached_len) stays owned
        by the request and the row's [0, aligned_len) is rewritten to the tree's slots.
        """
        row, cached_len = req.req_pool_idx, req.cached_len
        assert row is not None, "cache_unfinished_req on a request without a row"
        req_to_token = self.req_to_token_pool.req_to_token
        slots = req_to_token[row, :cached_len].to(torch.int64)
        aligned_len = cached_len // self.page_size * self.page_size
        prefix_len = len(req.prefix_indices)
        key = req.all_ids[:aligned_len]
        already_len = self.insert(key, slots[:aligned_len])
        self.token_to_kv_pool_allocator.free(slots[prefix_len:already_len])

        new_indices, new_node = self.match_prefix(key)
        assert len(new_indices) == aligned_len, "just-inserted prefix did not match in full"
        req_to_token[row, :aligned_len] = new_indices.to(req_to_token.dtype)
        self.inc_lock_ref(new_node)          # lock the new path before unlocking the old one
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_node

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
        upper.children[self._child_key(child.key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        leaf = TreeNode(list(key), value.clone(), parent)
        parent.children[self._child_key(key)] = leaf
        self._evictable_size += len(key)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._child_key(leaf.key)]
        self._evictable_size -= len(leaf.key)
        return parent

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
