"""Tests for RadixCache, ChunkCache and the request-level caching of KVManager.

A hypothesis state machine drives random insert / match / lock / unlock / evict sequences and
compares the tree against a plain reference model: a dict from every cached page-aligned prefix
(a tuple of token ids) to the KV slots of its last page (one slot when page_size is 1). The tree
never frees: the test frees what `insert` leaves and what `evict` returns, through an allocator
that fails on a double free. In the events machines the tree reports KV events all along: a
`BlockIndex` fed with them alone must hold exactly the reference's prefixes after every step
(and every hash must be the documented one). Unit tests cover KVManager's
request-level helpers over both caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.runtime.mem_cache.chunk_cache import ChunkCache
from radixlm.runtime.mem_cache.kv_events import KVEventRecorder
from radixlm.runtime.mem_cache.kv_manager import KVManager
from radixlm.runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.mem_cache.radix_cache import RadixCache
from radixlm.runtime.mem_cache.tree_node import TreeNode
from radixlm.testing.kv_events import BlockIndex

Prefix = tuple[int, ...]
PageSlots = tuple[int, ...]


class CheckingAllocator(TokenToKVPoolAllocator):
    """An allocator that fails on a double free and logs every freed slot."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self.held_pages: set[int] = set()
        self.freed_log: list[int] = []

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        slots = super().alloc(num_tokens)
        if slots is not None:
            self.held_pages |= set((slots // self.page_size).tolist())
        return slots

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int],
                     last_locs: list[int]) -> torch.Tensor | None:
        slots = super().alloc_extend(prefix_lens, seq_lens, last_locs)
        if slots is not None:
            self.held_pages |= set((slots // self.page_size).tolist())
        return slots

    def free(self, slots: torch.Tensor) -> None:
        pages = set((slots // self.page_size).tolist())
        assert pages <= self.held_pages, f"double free or foreign pages: {pages - self.held_pages}"
        self.held_pages -= pages
        self.freed_log.extend(slots.tolist())
        super().free(slots)


def make_cache(page_size: int, num_pages: int) -> tuple[RadixCache, CheckingAllocator]:
    """A bare tree and an allocator for its slots (the test plays the KV manager)."""
    return RadixCache(page_size), CheckingAllocator(num_pages, page_size)


def make_kv(page_size: int, num_pages: int, rows: int = 4,
            disable_radix_cache: bool = False) -> tuple[KVManager, ReqToTokenPool, CheckingAllocator]:
    """A KVManager whose allocator checks every free."""
    kv = KVManager(num_pages, page_size, rows - 1, 56, "cpu", disable_radix_cache)
    kv.allocator = CheckingAllocator(num_pages, page_size)
    return kv, kv.req_to_token_pool, kv.allocator


def evict_and_free(cache: RadixCache, allocator: TokenToKVPoolAllocator, n: int) -> int:
    """What KVManager does to make room: evict, then free what the tree handed back."""
    slots = cache.evict(n)
    allocator.free(slots)
    return len(slots)


def tree_contents(cache: RadixCache) -> dict[Prefix, PageSlots]:
    """Walk the tree into the reference representation {prefix: slots of its last page}."""
    P = cache.page_size
    out: dict[Prefix, PageSlots] = {}
    stack: list[tuple[TreeNode, Prefix]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        assert len(node.key) == len(node.value)
        assert len(node.key) % P == 0
        values = node.value.tolist()
        for end in range(P, len(node.key) + 1, P):
            out[path + tuple(node.key[:end])] = tuple(values[end - P: end])
        stack.extend((c, path + tuple(node.key)) for c in node.children.values())
    return out


def node_path(node: TreeNode) -> Prefix:
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def ref_match(ref: dict[Prefix, PageSlots], key: list[int], page_size: int) -> list[int]:
    """Slots of the longest page-aligned cached prefix of `key` in the reference model."""
    out: list[int] = []
    end = page_size
    while end <= len(key) and tuple(key[:end]) in ref:
        out.extend(ref[tuple(key[:end])])
        end += page_size
    return out


def page_prefixes(key: Prefix, page_size: int) -> set[Prefix]:
    return {key[:end] for end in range(page_size, len(key) + 1, page_size)}


# ---------------------------------------------------------------- property tests
PAGES = {
    1: [[0], [1], [2]],
    # pages that share leading tokens, so partial-page agreement must not count as a match
    4: [[0, 0, 0, 0], [0, 0, 0, 1], [1, 2, 1, 2]],
}


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 40
    with_events = False

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.allocator = make_cache(self.page_size, self.num_pages)
        if self.with_events:
            self.cache.events = KVEventRecorder(self.page_size, "CPU")
        self.index = BlockIndex()
        self.ref: dict[Prefix, PageSlots] = {}
        self.locks: list[tuple[TreeNode, Prefix]] = []

    @staticmethod
    def keys(page_size: int) -> st.SearchStrategy[list[int]]:
        pages = st.lists(st.sampled_from(PAGES[page_size]), max_size=12 // page_size + 1)
        return pages.map(lambda ps: [t for p in ps for t in p])

    def _evict_checked(self, n: int) -> int:
        before_evictable = self.cache.evictable_size()
        self.allocator.freed_log.clear()
        evicted = self.cache.evict(n)
        assert evicted.dtype == torch.int64
        freed = len(evicted)
        self.allocator.free(evicted)              # the tree hands slots back; it never frees them
        freed_slots = set(self.allocator.freed_log)
        assert len(freed_slots) == len(self.allocator.freed_log) == freed
        removed = {p for p, s in self.ref.items() if freed_slots.issuperset(s)}
        assert len(removed) * self.page_size == freed, "evicted slots that the tree did not hold"
        for _, locked in self.locks:
            assert not (page_prefixes(locked, self.page_size) & removed), "evicted a locked node"
        for p in removed:
            del self.ref[p]
        assert freed <= before_evictable
        assert freed >= n or self.cache.evictable_size() == 0
        return freed

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        key = data.draw(self.keys(self.page_size))
        if self.allocator.available_size() < len(key):
            self._evict_checked(len(key) - self.allocator.available_size())
        slots = self.allocator.alloc(len(key))
        if slots is None:
            return
        expected = len(ref_match(self.ref, key, self.page_size))
        already, cached = self.cache.insert(key, slots)
        assert already == expected and cached == len(key)
        self.allocator.free(slots[:already])        # the caller's duplicates
        P = self.page_size
        for end in range(already + P, len(key) + 1, P):
            self.ref[tuple(key[:end])] = tuple(slots[end - P: end].tolist())

    def _match_checked(self, key: list[int]) -> tuple[TreeNode, Prefix]:
        expected = ref_match(self.ref, key, self.page_size)
        kv_indices, last_node = self.cache.match_prefix(key)
        assert kv_indices.dtype == torch.int64
        assert kv_indices.tolist() == expected
        assert node_path(last_node) == tuple(key[: len(expected)])
        return last_node, tuple(key[: len(expected)])

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.page_size - 1))
        self._match_checked(data.draw(self.keys(self.page_size)) + tail)

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.page_size - 1))
        key = data.draw(self.keys(self.page_size)) + tail
        shape = [(n.id, len(n.key), n.last_access) for n in self.cache._nodes()]
        length, node, node_len = self.cache.peek_prefix(key)
        assert length == len(ref_match(self.ref, key, self.page_size))
        assert node_path(node)[: len(node_path(node)) - len(node.key) + node_len] == tuple(key[:length])
        assert [(n.id, len(n.key), n.last_access) for n in self.cache._nodes()] == shape   # changed nothing

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        node, prefix = self._match_checked(data.draw(self.keys(self.page_size)))
        self.cache.inc_lock_ref(node)
        self.locks.append((node, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 16))
    def evict(self, n: int) -> None:
        self._evict_checked(n)

    @invariant()
    def tree_matches_reference(self) -> None:
        assert tree_contents(self.cache) == self.ref

    @invariant()
    def events_rebuild_the_tree(self) -> None:
        if not self.with_events:
            return
        for event in self.cache.events.take():
            self.index.apply(event)
        assert self.index.prefixes() == set(self.ref)

    @invariant()
    def sizes_add_up(self) -> None:
        cache = self.cache
        P = self.page_size
        assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(self.ref) * P
        protected = set().union(*(page_prefixes(locked, P) for _, locked in self.locks))
        assert cache.protected_size() == len(protected) * P

    @invariant()
    def lock_refs_match_locks(self) -> None:
        stack = list(self.cache.root.children.values())
        while stack:
            node = stack.pop()
            path = node_path(node)
            expected = sum(1 for _, locked in self.locks if locked[: len(path)] == path)
            assert node.lock_ref == expected
            stack.extend(node.children.values())

    @invariant()
    def no_slot_leaked(self) -> None:
        values = self.cache.all_values().tolist()
        assert len(set(values)) == len(values)
        assert len(values) + self.allocator.available_size() == self.allocator.size
        assert set(v // self.page_size for v in values) == self.allocator.held_pages


class CacheMachinePage4(CacheMachine):
    page_size = 4
    num_pages = 10


_machine_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestRadixCachePage1 = CacheMachine.TestCase
TestRadixCachePage1.settings = _machine_settings
TestRadixCachePage4 = CacheMachinePage4.TestCase
TestRadixCachePage4.settings = _machine_settings


class CacheMachineEvents(CacheMachine):
    with_events = True


class CacheMachineEventsPage4(CacheMachinePage4):
    with_events = True


_events_settings = settings(_machine_settings, max_examples=30)
TestKVEventsPage1 = CacheMachineEvents.TestCase
TestKVEventsPage1.settings = _events_settings
TestKVEventsPage4 = CacheMachineEventsPage4.TestCase
TestKVEventsPage4.settings = _events_settings


# ---------------------------------------------------------------- focused unit tests
def test_match_splits_node_and_keeps_sizes() -> None:
    cache, allocator = make_cache(1, 16)
    cache.insert([1, 2, 3, 4], allocator.alloc(4))
    kv, node = cache.match_prefix([1, 2, 9])
    assert len(kv) == 2 and node.key == [1, 2] and list(node.children.values())[0].key == [3, 4]
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)
    assert evict_and_free(cache, allocator, 10) == 2  # only the unlocked [3, 4] goes
    assert cache.total_size() == 2 and evict_and_free(cache, allocator, 10) == 0
    cache.dec_lock_ref(node)
    assert evict_and_free(cache, allocator, 10) == 2 and cache.total_size() == 0
    assert allocator.available_size() == allocator.size


def test_tree_never_frees() -> None:
    cache, allocator = make_cache(1, 16)
    slots = allocator.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    free_before = allocator.available_size()
    evicted = cache.evict(10)
    assert sorted(evicted.tolist()) == sorted(slots.tolist())
    assert allocator.available_size() == free_before and allocator.freed_log == []
    assert cache.evict(0).numel() == 0


def test_page_aligned_match_ignores_partial_pages() -> None:
    cache, allocator = make_cache(4, 8)
    slots = allocator.alloc(8)
    cache.insert([5, 5, 5, 5, 6, 6, 6, 6], slots)
    assert cache.match_prefix([5, 5, 5, 5, 6, 6, 6]).kv_indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([5, 5, 5, 5, 6, 6, 6, 7]).kv_indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([5, 5, 5]).kv_indices.numel() == 0
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], allocator.alloc(3))


def test_evict_is_least_recently_used_first() -> None:
    cache, allocator = make_cache(1, 16)
    cache.insert([1, 1], allocator.alloc(2))
    cache.insert([2, 2], allocator.alloc(2))
    cache.insert([3, 3], allocator.alloc(2))
    cache.match_prefix([1, 1])                        # [2, 2] is now the oldest
    assert evict_and_free(cache, allocator, 1) == 2
    assert cache.match_prefix([2, 2]).kv_indices.numel() == 0
    assert len(cache.match_prefix([1, 1]).kv_indices) == 2
    assert len(cache.match_prefix([3, 3]).kv_indices) == 2


def test_evict_repushes_parent_that_becomes_leaf() -> None:
    cache, allocator = make_cache(1, 16)
    cache.insert([1, 2, 3], allocator.alloc(3))
    dup = allocator.alloc(3)
    assert cache.insert([1, 2, 4], dup) == (2, 3)     # splits: [1, 2] -> {[3], [4]}
    allocator.free(dup[:2])
    assert evict_and_free(cache, allocator, 3) == 4   # two 1-token leaves, then the re-pushed parent
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert allocator.available_size() == allocator.size


def test_reset_and_pretty_print() -> None:
    cache, allocator = make_cache(1, 16)
    cache.insert([1, 2, 3], allocator.alloc(3))
    assert "[1, 2, 3]" in cache.pretty_print()
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.all_values().numel() == 0


# ---------------------------------------------------------------- request-level helpers (KVManager)
@dataclass
class FakeReq:
    all_ids: list[int]
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None


def admit(kv: KVManager, req: FakeReq) -> None:
    """What the planner does on admission: match and lock the prefix, take a row."""
    match = kv.match_prefix(req.all_ids)
    kv.lock(match.last_node)
    assert kv.admit(req, match)


def extend(kv: KVManager, req: FakeReq, upto: int) -> None:
    """Allocate slots for tokens [kv_committed_len, upto) as a forward pass would."""
    assert kv.alloc_extend([req], [upto - req.kv_committed_len]) is not None
    req.kv_committed_len = upto


def owned_pages(pool: ReqToTokenPool, req: FakeReq, page_size: int) -> set[int]:
    row = pool.req_to_token[req.req_pool_idx]
    return set((row[len(req.prefix_indices): req.kv_committed_len] // page_size).tolist())


def assert_no_leak(kv: KVManager, live: list[FakeReq] = ()) -> None:
    allocator, pool = kv.allocator, kv.req_to_token_pool
    P = allocator.page_size
    tree_pages = set((kv.prefix_cache.all_values() // P).tolist())
    req_pages = [owned_pages(pool, req, P) for req in live]
    assert all(not (tree_pages & p) for p in req_pages)
    held = tree_pages.union(*req_pages)
    assert held == allocator.held_pages
    assert len(held) * P + allocator.available_size() == allocator.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_reqs_share_prefix(page_size: int) -> None:
    kv, pool, allocator = make_kv(page_size, 16)
    cache = kv.prefix_cache
    a = FakeReq(list(range(10)))
    admit(kv, a)
    extend(kv, a, 10)
    a_slots = pool.req_to_token[a.req_pool_idx, :10].tolist()
    kv.cache_finished_req(a)
    assert (a.req_pool_idx, a.last_node, len(a.prefix_indices)) == (None, None, 0)
    kv.cache_finished_req(a)                          # a second call (abort after finish) frees nothing
    assert cache.total_size() == 10 // page_size * page_size
    assert pool.available_size() == pool.size
    assert_no_leak(kv)

    b = FakeReq(list(range(8)) + [99, 98, 97])
    admit(kv, b)
    assert b.prefix_indices.tolist() == a_slots[:8]
    assert pool.req_to_token[b.req_pool_idx, :8].tolist() == a_slots[:8]
    assert cache.protected_size() == 8
    extend(kv, b, 11)
    assert_no_leak(kv, [b])
    kv.cache_finished_req(b)
    assert cache.protected_size() == 0
    assert cache.total_size() == 10 // page_size * page_size + 3 // page_size * page_size
    assert_no_leak(kv)
    assert kv.ensure_free(kv.total_tokens)            # evicts everything
    assert allocator.available_size() == allocator.size and kv.is_fully_free()


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_req_frees_duplicates(page_size: int) -> None:
    kv, pool, allocator = make_kv(page_size, 32)
    a, b = FakeReq([7] * 9), FakeReq([7] * 9)
    for req in (a, b):                                # both admitted before either is cached
        admit(kv, req)
        extend(kv, req, 9)
    a_slots = pool.req_to_token[a.req_pool_idx, :9].tolist()
    kv.cache_finished_req(a)
    kv.cache_finished_req(b)                          # b's [0, 8) duplicates a's
    assert kv.prefix_cache.all_values().tolist() == a_slots[: 9 // page_size * page_size]
    assert_no_leak(kv)


def test_unfinished_req_chunked_prefill_page4() -> None:
    kv, pool, allocator = make_kv(4, 16)
    cache = kv.prefix_cache
    req = FakeReq(list(range(11)))
    admit(kv, req)
    extend(kv, req, 5)                                # chunk 1: tokens [0, 5)
    own_first_page = pool.req_to_token[req.req_pool_idx, :4].tolist()
    kv.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == own_first_page
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert_no_leak(kv, [req])                         # slot 4's page stays with the request

    other = FakeReq(list(range(8)) + [50])            # computes [4, 8) too and finishes first
    admit(kv, other)
    extend(kv, other, 9)
    other_slots = pool.req_to_token[other.req_pool_idx, :8].tolist()
    kv.cache_finished_req(other)

    extend(kv, req, 10)                               # chunk 2: tokens [5, 10)
    kv.cache_unfinished_req(req)                      # its [4, 8) duplicates other's
    assert req.prefix_indices.tolist() == other_slots
    assert pool.req_to_token[req.req_pool_idx, :8].tolist() == other_slots
    assert cache.protected_size() == 8
    assert_no_leak(kv, [req])

    extend(kv, req, 11)
    kv.cache_finished_req(req)
    assert cache.protected_size() == 0 and pool.available_size() == pool.size
    assert_no_leak(kv)
    assert evict_and_free(cache, allocator, 100) == 8
    assert allocator.available_size() == allocator.size


def test_unfinished_req_page1_keeps_running() -> None:
    kv, pool, allocator = make_kv(1, 32)
    cache = kv.prefix_cache
    req = FakeReq(list(range(20)))
    admit(kv, req)
    for upto in (6, 12, 20):
        extend(kv, req, upto)
        kv.cache_unfinished_req(req)
        assert len(req.prefix_indices) == upto == cache.protected_size()
        assert cache.evict(100).numel() == 0          # everything is locked by the request
    kv.cache_finished_req(req)
    assert cache.evictable_size() == 20
    assert_no_leak(kv)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache(page_size: int) -> None:
    kv, pool, allocator = make_kv(page_size, 16, disable_radix_cache=True)
    cache = kv.prefix_cache
    assert isinstance(cache, ChunkCache)
    req = FakeReq(list(range(11)))
    admit(kv, req)
    assert req.kv_committed_len == 0
    extend(kv, req, 6)
    own = pool.req_to_token[req.req_pool_idx, :6].tolist()
    kv.cache_unfinished_req(req)                      # nothing is shared: the slots stay the request's
    assert pool.req_to_token[req.req_pool_idx, :6].tolist() == own
    assert req.prefix_indices.numel() == 0 and allocator.freed_log == []
    assert_no_leak(kv, [req])
    extend(kv, req, 11)
    assert pool.req_to_token[req.req_pool_idx, :6].tolist() == own
    assert kv.match_prefix(req.all_ids).kv_indices.numel() == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    assert cache.evict(5).numel() == 0
    row_slots = pool.req_to_token[req.req_pool_idx, :11].tolist()
    kv.cache_finished_req(req)
    assert (req.req_pool_idx, req.last_node) == (None, None)
    assert sorted(allocator.freed_log) == sorted(row_slots)   # every slot of the request, once
    assert allocator.available_size() == allocator.size and pool.available_size() == pool.size
    assert not allocator.held_pages
