"""The DP router's policies, as pure logic (the end-to-end DP test is in tests/e2e/test_scale_out.py)."""

from __future__ import annotations

import random

from radixlm.runtime.router.dp_router import CHUNK, ChunkedTrie, DPRouter


def _prompt(rng: random.Random, prefix: list[int], n: int) -> list[int]:
    return prefix + [rng.randrange(1000) for _ in range(n)]


def test_approx_tree_matches_chunked_prefixes():
    t = ChunkedTrie()
    ids = list(range(100))
    t.insert(ids)
    assert t.match(ids) == 96
    assert t.match(ids[:40] + [7] * 60) == 32
    assert t.match([5] + ids) == 0


def test_round_robin_and_shortest_queue():
    r = DPRouter("round_robin", 3)
    assert [r.pick([1, 2, 3]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    s = DPRouter("shortest_queue", 2)
    a, b = s.pick([1]), s.pick([1])
    assert {a, b} == {0, 1}
    s.finish(a)
    assert s.pick([1]) == a


def test_cache_aware_groups_shared_prefixes_on_one_replica():
    rng = random.Random(0)
    router = DPRouter("cache_aware", 2)
    groups = [[rng.randrange(1000) for _ in range(8 * CHUNK)] for _ in range(4)]
    placement: dict[int, set[int]] = {g: set() for g in range(4)}
    for i in range(32):
        g = i % 4
        rank = router.pick(_prompt(rng, groups[g], 20))
        placement[g].add(rank)
        router.finish(rank)       # requests complete quickly: load stays balanced
    assert all(len(ranks) == 1 for ranks in placement.values())
    assert {next(iter(r)) for r in placement.values()} == {0, 1}   # both replicas used


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    router = DPRouter("cache_aware", 2)
    prefix = list(range(10 * CHUNK))
    picks = [router.pick(prefix + [i]) for i in range(30)]     # nothing finishes
    assert picks.count(0) < 30 and picks.count(1) > 0
