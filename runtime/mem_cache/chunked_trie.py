"""ChunkedTrie: a token trie without KV, for "would this prompt share a prefix with those?".

It indexes prompts in CHUNK-token pieces and is pruned LRU. The DP router keeps one per replica
(prompts routed there); the batch planner keeps one per step (prompts being prefilled now).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

CHUNK = 16
MAX_NODES = 100_000


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    parent: _Node | None = None
    key: tuple[int, ...] = ()
    last_use: int = 0


class ChunkedTrie:
    """Chunked token trie; `match` returns how many leading tokens were inserted before."""

    def __init__(self) -> None:
        self.root = _Node()
        self.size = 0
        self._clock = itertools.count()

    def insert(self, ids: list[int]) -> None:
        node, now = self.root, next(self._clock)
        for i in range(0, len(ids) - len(ids) % CHUNK, CHUNK):
            key = tuple(ids[i:i + CHUNK])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(parent=node, key=key)
                self.size += 1
            child.last_use = now
            node = child
        if self.size > MAX_NODES:
            self._prune(self.size - MAX_NODES * 3 // 4)

    def match(self, ids: list[int]) -> int:
        node, n = self.root, 0
        for i in range(0, len(ids) - len(ids) % CHUNK, CHUNK):
            node = node.children.get(tuple(ids[i:i + CHUNK]))
            if node is None:
                break
            n += CHUNK
        return n

    def _prune(self, count: int) -> None:
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                leaves.append(node)
        for leaf in sorted(leaves, key=lambda n: n.last_use)[:count]:
            del leaf.parent.children[leaf.key]
            self.size -= 1
