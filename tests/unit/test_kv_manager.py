"""KVManager without a model: admission, allocation, caching, eviction and flush keep every slot
in exactly one place, and the manager is the only writer of the req->token table."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from sched_fakes import assert_slots_partitioned, make_kv, make_req

import radixlm.runtime as runtime_pkg
from radixlm.runtime.mem_cache.chunk_cache import ChunkCache
from radixlm.runtime.mem_cache.radix_cache import RadixCache


def admit(kv, req) -> None:
    match = kv.match_prefix(req.all_ids[: req.max_prefix_for_match()])
    kv.lock(match.last_node)
    assert kv.admit(req, match)


def extend(kv, req, n: int) -> torch.Tensor:
    loc = kv.alloc_extend([req], [n])
    assert loc is not None
    req.kv_committed_len += n
    return loc


@pytest.mark.parametrize("page_size", [1, 4])
def test_round_trip_returns_to_fully_free(page_size: int) -> None:
    kv = make_kv(64, page_size)
    assert isinstance(kv.prefix_cache, RadixCache)
    req = make_req("a", list(range(3, 13)))
    admit(kv, req)
    assert (req.kv_committed_len, req.req_pool_idx is not None) == (0, True)
    loc = extend(kv, req, 10)
    row = kv.req_to_token_pool.req_to_token[req.req_pool_idx, :10].long()
    assert torch.equal(row, loc)                      # the manager wrote the slots into the row
    assert kv.used_tokens() == len(set((loc // page_size).tolist())) * page_size
    assert not kv.is_fully_free()
    kv.cache_finished_req(req)
    assert kv.prefix_cache.total_size() == 10 // page_size * page_size
    assert kv.free_tokens() + kv.evictable_tokens() == kv.total_tokens
    assert kv.is_fully_free() and kv.used_tokens() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_hit_writes_the_cached_slots_into_the_new_row(page_size: int) -> None:
    kv = make_kv(64, page_size)
    a = make_req("a", list(range(3, 15)))
    admit(kv, a)
    a_slots = extend(kv, a, 12)
    kv.cache_finished_req(a)
    b = make_req("b", list(range(3, 11)) + [50, 51])
    admit(kv, b)
    assert b.kv_committed_len == 8 and b.prefix_indices.tolist() == a_slots[:8].tolist()
    assert kv.req_to_token_pool.req_to_token[b.req_pool_idx, :8].long().tolist() == a_slots[:8].tolist()
    assert kv.protected_tokens() == 8
    extend(kv, b, 2)
    assert_slots_partitioned(kv, [b])
    kv.cache_finished_req(b)
    assert kv.is_fully_free()


def test_lock_reports_tokens_moved_out_of_evictable() -> None:
    kv = make_kv(64)
    a = make_req("a", list(range(3, 11)))
    admit(kv, a)
    extend(kv, a, 8)
    kv.cache_finished_req(a)
    match = kv.match_prefix(list(range(3, 9)))
    assert kv.lock(match.last_node) == 6 and kv.evictable_tokens() == 2
    assert not kv.ensure_free(kv.total_tokens)        # the locked 6 cannot be evicted
    assert kv.evictable_tokens() == 0 and kv.free_tokens() == kv.total_tokens - 6
    kv.unlock(match.last_node)
    assert kv.ensure_free(kv.total_tokens) and kv.prefix_cache.total_size() == 0


def test_alloc_evicts_the_cache_and_fails_cleanly_when_full() -> None:
    kv = make_kv(32)
    a = make_req("a", list(range(3, 23)))
    admit(kv, a)
    extend(kv, a, 20)
    kv.cache_finished_req(a)                          # 20 evictable, 12 free
    b = make_req("b", [99] * 30)
    admit(kv, b)
    extend(kv, b, 30)                                 # needs 18 of the cached slots
    assert kv.prefix_cache.total_size() <= 2
    free_before = kv.free_tokens()
    assert kv.alloc_extend([b], [5]) is None          # nothing left to evict: no change
    assert kv.free_tokens() == free_before and b.kv_committed_len == 30
    kv.cache_finished_req(b)
    assert kv.is_fully_free()


def test_abort_before_and_after_caching_is_idempotent() -> None:
    kv = make_kv(64)
    never = make_req("never", [5, 6, 7])
    kv.cache_finished_req(never)                      # never admitted: nothing to free
    req = make_req("a", list(range(3, 20)))
    admit(kv, req)
    extend(kv, req, 17)
    kv.cache_finished_req(req)
    kv.cache_finished_req(req)                        # an abort after finishing frees nothing more
    assert kv.is_fully_free() and kv.prefix_cache.total_size() == 17


@pytest.mark.parametrize("disable_radix_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_keeps_the_request_its_slots(page_size: int, disable_radix_cache: bool) -> None:
    kv = make_kv(64, page_size, disable_radix_cache=disable_radix_cache)
    assert isinstance(kv.prefix_cache, ChunkCache) == disable_radix_cache
    req = make_req("a", list(range(3, 21)))
    admit(kv, req)
    for n in (7, 6, 5):
        extend(kv, req, n)
        kv.cache_unfinished_req(req)
        row = kv.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].long()
        assert len(set(row.tolist())) == req.kv_committed_len
        assert_slots_partitioned(kv, [req])
        expected_prefix = 0 if disable_radix_cache else req.kv_committed_len // page_size * page_size
        assert len(req.prefix_indices) == expected_prefix == kv.protected_tokens()
    kv.cache_finished_req(req)
    assert kv.is_fully_free()
    assert kv.prefix_cache.total_size() == (0 if disable_radix_cache else 18 // page_size * page_size)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_request_mix_never_loses_a_slot(seed: int, page_size: int) -> None:
    """Random admissions, chunks, decodes, finishes and retractions over a small shared vocabulary."""
    rng = random.Random(seed)
    kv = make_kv(160, page_size, max_running=6)
    live = []
    for step in range(120):
        op = rng.random()
        if op < 0.3 and len(live) < 5:
            ids = [rng.choice([3, 4, 5]) for _ in range(rng.randint(1, 12))] * rng.randint(1, 2)
            req = make_req(f"r{step}", ids)
            match = kv.match_prefix(req.all_ids[: req.max_prefix_for_match()])
            kv.lock(match.last_node)
            if kv.admit(req, match):
                live.append(req)
            else:
                kv.unlock(match.last_node)
        elif op < 0.7 and live:
            req = rng.choice(live)
            n = rng.randint(1, 6)
            if req.kv_committed_len + n > req.seq_len:
                req.output_ids.extend(rng.choice([3, 4]) for _ in range(req.kv_committed_len + n - req.seq_len))
            if kv.alloc_extend([req], [n]) is not None:
                req.kv_committed_len += n
                if rng.random() < 0.5:
                    kv.cache_unfinished_req(req)
        elif live:
            req = live.pop(rng.randrange(len(live)))
            kv.cache_finished_req(req)                # finished, aborted or retracted alike
        assert_slots_partitioned(kv, live)
    for req in live:
        kv.cache_finished_req(req)
    assert kv.is_fully_free()
    kv.flush()
    assert kv.free_tokens() == kv.total_tokens and kv.prefix_cache.total_size() == 0


def test_flush_forgets_everything() -> None:
    kv = make_kv(64, 4)
    req = make_req("a", list(range(3, 20)))
    admit(kv, req)
    extend(kv, req, 17)
    kv.cache_finished_req(req)
    assert kv.prefix_cache.total_size() == 16
    kv.flush()
    assert kv.free_tokens() == kv.total_tokens and kv.prefix_cache.total_size() == 0
    assert kv.match_prefix(list(range(3, 20))).kv_indices.numel() == 0


def test_only_the_kv_manager_writes_the_table() -> None:
    """No runtime module but kv_manager.py assigns into req_to_token (directly or through a local
    `table` alias of it), and nothing else frees KV slots or rows."""
    root = Path(runtime_pkg.__file__).parent
    write = re.compile(r"req_to_token\w*\[[^\]]*\]\s*=[^=]|\btable\[[^\]]*\]\s*=[^=]")
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "req_to_token" in p.read_text() and write.search(p.read_text()))
    assert writers == ["mem_cache/kv_manager.py"], writers
    free = re.compile(r"\.free\(")
    freers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if free.search(p.read_text()))
    assert freers == ["mem_cache/kv_manager.py"], freers
