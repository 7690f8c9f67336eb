"""The waiting-queue policies (--schedule-policy) on real Reqs and a real RadixCache, no model."""

from __future__ import annotations

import random

import pytest
import torch
from sched_fakes import make_req

from radixlm.runtime.managers.schedule_policy import CACHE_AWARE_MAX_QUEUE, POLICIES, order_waiting
from radixlm.runtime.mem_cache.chunk_cache import ChunkCache
from radixlm.runtime.mem_cache.radix_cache import RadixCache
from radixlm.runtime.server_args import SCHEDULE_POLICIES


def queue(*specs: tuple[str, list[int], int, int]):
    """Reqs (rid, ids, max_new_tokens, priority), arriving in the given order."""
    reqs = [make_req(rid, ids, max_new, priority) for rid, ids, max_new, priority in specs]
    for i, req in enumerate(reqs):
        req.arrival_time = float(i)
    return reqs


def cache_with(*prefixes: list[int]) -> RadixCache:
    cache = RadixCache(page_size=1)
    slot = 1
    for ids in prefixes:
        cache.insert(ids, torch.arange(slot, slot + len(ids)))
        slot += len(ids)
    return cache


def rids(reqs) -> list[str]:
    return [req.rid for req in reqs]


def test_every_cli_policy_is_registered() -> None:
    assert set(POLICIES) == set(SCHEDULE_POLICIES)


def test_fcfs_is_arrival_order() -> None:
    reqs = queue(("a", [3], 8, 0), ("b", [4], 8, 0), ("c", [5], 8, 0))
    assert rids(order_waiting("fcfs", list(reversed(reqs)), ChunkCache(1), radix_enabled=False)) == ["a", "b", "c"]


def test_lof_runs_longest_output_first_then_arrival() -> None:
    reqs = queue(("a", [3], 4, 0), ("b", [4], 64, 0), ("c", [5], 16, 0), ("d", [6], 64, 0))
    assert rids(order_waiting("lof", reqs, ChunkCache(1), radix_enabled=False)) == ["b", "d", "c", "a"]


def test_priority_runs_higher_priority_first_then_arrival() -> None:
    reqs = queue(("a", [3], 8, 0), ("b", [4], 8, 5), ("c", [5], 8, -1), ("d", [6], 8, 5))
    assert rids(order_waiting("priority", reqs, ChunkCache(1), radix_enabled=False)) == ["b", "d", "a", "c"]


def test_random_is_a_permutation_and_leaves_the_queue_alone() -> None:
    reqs = queue(*[(f"r{i}", [3 + i], 8, 0) for i in range(20)])
    before = list(reqs)
    random.seed(1)
    out = order_waiting("random", reqs, ChunkCache(1), radix_enabled=False)
    assert sorted(rids(out)) == sorted(rids(reqs)) and reqs == before
    assert rids(out) != rids(reqs)                    # 20! orders: seed 1 does not give the identity


def test_lpm_runs_longest_cached_prefix_first() -> None:
    cache = cache_with(list(range(3, 23)), [90, 91, 92, 93])
    reqs = queue(("none", [50, 51, 52], 8, 0), ("short", [90, 91, 92, 93, 7], 8, 0),
                 ("long", list(range(3, 23)) + [7], 8, 0), ("mid", list(range(3, 13)) + [8], 8, 0))
    before = cache.total_size()
    out = order_waiting("lpm", reqs, cache, radix_enabled=True)
    assert rids(out) == ["long", "mid", "short", "none"]
    assert cache.protected_size() == 0 and cache.total_size() == before   # no lock taken, nothing freed


def test_dfs_weight_keeps_shared_prefixes_together_heaviest_first() -> None:
    a, b = list(range(3, 13)), list(range(40, 50))
    cache = cache_with(a, b)
    reqs = queue(("b1", b + [1], 8, 0), ("a1", a + [1], 8, 0), ("x", [99, 98], 8, 0),
                 ("a2", a + [2], 8, 0), ("b2", b + [2], 8, 0), ("a3", a + [3], 8, 0))
    out = rids(order_waiting("dfs-weight", reqs, cache, radix_enabled=True))
    assert out[0] == "x"                              # waits at the root: visited first
    assert out[1:4] == ["a1", "a2", "a3"]             # three requests under `a` before two under `b`
    assert out[4:] == ["b1", "b2"]
    assert cache.protected_size() == 0


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_ordering_leaves_the_tree_as_it_was(policy: str) -> None:
    a = list(range(3, 23))
    cache = cache_with(a, [90, 91, 92, 93])
    reqs = queue(("mid", a[:7] + [1], 8, 0), ("mid2", a[:12] + [2], 8, 0), ("long", a + [7], 8, 0),
                 ("x", [99], 8, 0))
    shape = [(n.id, n.key, n.last_access) for n in cache._nodes()]
    out = rids(order_waiting(policy, reqs, cache, radix_enabled=True))
    assert [(n.id, n.key, n.last_access) for n in cache._nodes()] == shape   # no split, no LRU refresh
    if policy == "lpm":
        assert out == ["long", "mid2", "mid", "x"]
    else:        # as if the matches had split `a` at 7 and 12: root, then down the one path
        assert out == ["x", "mid", "mid2", "long"]


@pytest.mark.parametrize("policy,arrival,cache_aware", [
    ("lpm", ["cold", "hot"], ["hot", "cold"]),          # the cached prefix first
    ("dfs-weight", ["hot", "cold"], ["cold", "hot"]),   # the root's requests first
])
def test_cache_aware_policies_fall_back_to_fcfs(policy: str, arrival: list[str], cache_aware: list[str]) -> None:
    cache = cache_with(list(range(3, 23)))
    ids = {"cold": [50, 51], "hot": list(range(3, 23)) + [1]}
    reqs = queue(*[(rid, ids[rid], 8, 0) for rid in arrival])
    assert rids(order_waiting(policy, reqs, cache, radix_enabled=True)) == cache_aware
    assert rids(order_waiting(policy, reqs, cache, radix_enabled=False)) == arrival
    many = queue(*[(f"r{i}", [50 + i % 7], 8, 0) for i in range(CACHE_AWARE_MAX_QUEUE)]
                 + [(rid, ids[rid], 8, 0) for rid in arrival])
    assert rids(order_waiting(policy, many[-2:], cache, radix_enabled=True)) == cache_aware
    assert rids(order_waiting(policy, many, cache, radix_enabled=True)) == rids(many)   # too long: fcfs
