"""Waiting-queue order (the --schedule-policy registry) and the prefill admission budget.

Cache-aware policies (lpm, dfs-weight) read the radix tree with `peek_prefix`, which changes
nothing (no split, no LRU refresh, no lock); the order they produce is only a preference:
admission matches and locks each request it takes.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..mem_cache.base_cache import BasePrefixCache
from ..utils import align_down
from .req import Req

CACHE_AWARE = ("lpm", "dfs-weight")
CACHE_AWARE_MAX_QUEUE = 128   # beyond this, matching every waiting prompt costs more than it saves


def order_fcfs(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda req: req.arrival_time)


def order_lof(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda req: (-req.sampling_params.max_new_tokens, req.arrival_time))


def order_random(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    out = list(waiting)
    random.shuffle(out)
    return out


def order_priority(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    return sorted(waiting, key=lambda req: (-req.priority, req.arrival_time))


def order_lpm(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    """Longest cached prefix first."""
    hit = {id(req): prefix_cache.peek_prefix(req.all_ids[: req.max_prefix_for_match()]).length
           for req in waiting}
    return sorted(waiting, key=lambda req: (-hit[id(req)], req.arrival_time))


def order_dfs_weight(waiting: list[Req], prefix_cache: BasePrefixCache) -> list[Req]:
    """Depth-first over the tree, heavier subtrees (more waiting requests) first, so requests that
    share a prefix run back to back while it is still cached."""
    at_node: dict[int, list[tuple[int, float, Req]]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        peek = prefix_cache.peek_prefix(req.all_ids[: req.max_prefix_for_match()])
        # a match ending inside a node sits where match_prefix would split it: above the node's
        # own requests and children, in the order of the split points
        at_node[id(peek.node)].append((peek.node_len, req.arrival_time, req))
        node = peek.node
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    out: list[Req] = []
    stack = [prefix_cache.root]
    while stack:
        node = stack.pop()
        out.extend(req for _, _, req in sorted(at_node.get(id(node), []), key=lambda e: e[:2]))
        kids = [c for c in node.children.values() if weight.get(id(c))]
        stack.extend(sorted(kids, key=lambda c: weight[id(c)]))   # heaviest popped first
    return out


POLICIES: dict[str, Callable[[list[Req], BasePrefixCache], list[Req]]] = {
    "fcfs": order_fcfs, "lof": order_lof, "random": order_random, "priority": order_priority,
    "lpm": order_lpm, "dfs-weight": order_dfs_weight,
}


def order_waiting(policy: str, waiting: list[Req], prefix_cache: BasePrefixCache, radix_enabled: bool) -> list[Req]:
    """`waiting` in the order admission should try; does not modify the queue or lock the cache."""
    if policy in CACHE_AWARE and (not radix_enabled or len(waiting) > CACHE_AWARE_MAX_QUEUE):
        policy = "fcfs"
    return POLICIES[policy](waiting, prefix_cache)


@dataclass
class PrefillBudget:
    """What one step may still take in.

    rem_total_tokens: KV slots free or evictable, minus the decode growth reserved for running requests.
    rem_input_tokens: new prompt tokens allowed in this step's batch (--max-prefill-tokens).
    chunk_tokens: max new tokens for one request in one step (--chunked-prefill-size; None: no chunking).
    rem_reqs: request rows left (--max-running-requests).
    """

    rem_total_tokens: int
    rem_input_tokens: int
    chunk_tokens: int | None
    rem_reqs: int
    page_size: int = 1

    def take(self, extend_len: int, reserve_decode: int) -> int:
        """Takes room for up to `extend_len` new tokens of one request plus, when they complete its
        prefill, `reserve_decode` tokens of decode growth (and one page of slack).

        Returns how many tokens fit (0: none, stop admitting) and charges the budgets for them.
        """
        if self.rem_reqs <= 0 or self.rem_input_tokens <= 0:
            return 0
        n = min(extend_len, self.rem_input_tokens)
        if self.chunk_tokens:
            n = min(n, self.chunk_tokens)
        if n < extend_len:   # a chunk ends on a page boundary so the tree can cache it
            n = align_down(n, self.page_size)
        need = n + self.page_size + (reserve_decode if n == extend_len else 0)
        if n <= 0 or need > self.rem_total_tokens:
            return 0
        self.rem_total_tokens -= need
        self.rem_input_tokens -= n
        self.rem_reqs -= 1
        return n
