"""Data-parallel router: picks the scheduler replica for each request (--load-balance-method).

- round_robin:     replicas in turn.
- shortest_queue:  the replica with the fewest requests in flight.
- cache_aware:     the replica whose approximate prefix tree (of prompts routed to it) shares the
                   longest prefix with this prompt, unless the load is imbalanced, in which case the
                   least-loaded replica. Like a hit in the real radix cache, a routed prompt's
                   prefix is then likely cached on that replica.

The approximate trees index prompts in CHUNK-token pieces; they hold no KV and are pruned LRU.
"""

from __future__ import annotations

import itertools

from ..mem_cache.chunked_trie import CHUNK, ChunkedTrie

BALANCE_ABS = 8        # imbalanced when max - min in-flight exceeds this ...
BALANCE_REL = 1.5      # ... and max exceeds min * this
MIN_MATCH_FRACTION = 0.25


class DPRouter:
    def __init__(self, method: str, dp_size: int):
        if method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"unknown load balance method {method!r}")
        self.method = method
        self.dp_size = dp_size
        self.in_flight = [0] * dp_size
        self.routed = [0] * dp_size
        self.trees = [ChunkedTrie() for _ in range(dp_size)]
        self._rr = itertools.cycle(range(dp_size))

    def pick(self, input_ids: list[int]) -> int:
        """Chooses a replica and records the request as in flight there (call `finish` later)."""
        if self.method == "round_robin":
            rank = next(self._rr)
        elif self.method == "shortest_queue" or self._imbalanced():
            rank = self._least_loaded()
        else:
            rank = self._best_match(input_ids)
        self.assign(rank, input_ids)
        return rank

    def assign(self, rank: int, input_ids: list[int]) -> None:
        """Records a request sent to `rank` without choosing (a session's later turns stay where
        its first went)."""
        if self.method == "cache_aware":
            self.trees[rank].insert(input_ids)
        self.in_flight[rank] += 1
        self.routed[rank] += 1

    def finish(self, rank: int) -> None:
        self.in_flight[rank] = max(self.in_flight[rank] - 1, 0)

    def _least_loaded(self) -> int:
        return min(range(self.dp_size), key=lambda r: (self.in_flight[r], self.routed[r]))

    def _imbalanced(self) -> bool:
        hi, lo = max(self.in_flight), min(self.in_flight)
        return hi - lo > BALANCE_ABS and hi > lo * BALANCE_REL

    def _best_match(self, ids: list[int]) -> int:
        matches = [t.match(ids) for t in self.trees]
        best = max(range(self.dp_size), key=lambda r: (matches[r], -self.in_flight[r]))
        if matches[best] >= max(CHUNK, MIN_MATCH_FRACTION * len(ids)):
            return best
        return self._least_loaded()

    def stats(self) -> list[dict]:
        return [{"dp_rank": r, "in_flight": self.in_flight[r], "routed": self.routed[r],
                 "approx_tree_chunks": self.trees[r].size} for r in range(self.dp_size)]
