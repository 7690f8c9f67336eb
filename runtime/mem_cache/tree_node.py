"""TreeNode: one edge of the radix tree, shared by RadixCache and ChunkCache (whose root it is)."""

from __future__ import annotations

import itertools

import torch

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
        self.block_hashes: list[int] = []    # KV-event hash of each page (only when events are on)

    def touch(self) -> None:
        self.last_access = next(_access_clock)

    def __lt__(self, other: TreeNode) -> bool:       # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"
