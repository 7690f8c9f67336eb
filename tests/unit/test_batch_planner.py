"""BatchPlanner and PrefillBudget without a model: admission, budgets, chunking, in-batch prefix
sharing and preemption, over a real KVManager with a fake forward pass (tests/unit/sched_fakes.py)."""

from __future__ import annotations

from sched_fakes import FakeLoop, make_kv, make_req

from radixlm.runtime.managers.schedule_policy import PrefillBudget


# ------------------------------------------------------------------ PrefillBudget
def test_budget_takes_whole_prompt_and_reserves_decode_room() -> None:
    b = PrefillBudget(rem_total_tokens=100, rem_input_tokens=50, chunk_tokens=None, rem_reqs=2)
    assert b.take(20, reserve_decode=10) == 20
    assert (b.rem_total_tokens, b.rem_input_tokens, b.rem_reqs) == (100 - 20 - 1 - 10, 30, 1)


def test_budget_stops_on_requests_input_and_total() -> None:
    assert PrefillBudget(100, 50, None, rem_reqs=0).take(5, 0) == 0
    assert PrefillBudget(100, 0, None, rem_reqs=3).take(5, 0) == 0
    b = PrefillBudget(rem_total_tokens=10, rem_input_tokens=50, chunk_tokens=None, rem_reqs=3)
    assert b.take(10, 0) == 0                         # 10 tokens + one page of slack do not fit
    assert (b.rem_total_tokens, b.rem_input_tokens, b.rem_reqs) == (10, 50, 3)   # nothing charged
    assert b.take(9, 0) == 9


def test_budget_chunks_on_page_boundaries_without_decode_reserve() -> None:
    b = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=1000, chunk_tokens=10, rem_reqs=4, page_size=4)
    assert b.take(30, reserve_decode=100) == 8        # chunk of 10, cut to whole pages; no reserve yet
    assert b.rem_total_tokens == 1000 - 8 - 4
    b = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=6, chunk_tokens=None, rem_reqs=4, page_size=4)
    assert b.take(30, 0) == 4                         # the step's input budget also cuts on a page
    assert b.take(30, 0) == 0                         # 2 tokens left: less than a page


# ------------------------------------------------------------------ admission
def test_admits_everything_that_fits_in_one_batch() -> None:
    loop = FakeLoop(make_kv(512))
    reqs = [make_req(f"r{i}", [10 + i] * (5 + i), max_new_tokens=3) for i in range(4)]
    loop.submit(*reqs)
    batch = loop.step()
    assert batch.reqs == reqs and batch.extend_lens == [5, 6, 7, 8]
    assert not loop.waiting and len({r.req_pool_idx for r in reqs}) == 4
    assert loop.step().is_decode
    loop.run()
    assert [len(r.output_ids) for r in loop.finished] == [3] * 4


def test_max_running_requests_bounds_admission() -> None:
    loop = FakeLoop(make_kv(512, max_running=2), max_running=2)
    loop.submit(*[make_req(f"r{i}", [20 + i] * 4, max_new_tokens=4) for i in range(5)])
    while loop.waiting or loop.running:
        loop.step()
        assert len(loop.running) <= 2
    assert loop.kv.is_fully_free() and len(loop.finished) == 5


def test_max_prefill_tokens_bounds_one_step() -> None:
    loop = FakeLoop(make_kv(512), max_prefill_tokens=20, chunked_prefill_size=-1)
    loop.submit(*[make_req(f"r{i}", [30 + i] * 8, max_new_tokens=2) for i in range(4)])
    first = loop.step()
    assert sum(n for r, n in zip(first.reqs, first.extend_lens)) <= 20
    assert len(first.reqs) == 3 and first.extend_lens == [8, 8, 4]   # the third is chunked by the budget
    loop.run()


def test_prefill_step_tokens_ends_a_step_between_whole_requests() -> None:
    """Past --prefill-step-tokens a step admits no one more, and cuts no prompt to fill itself."""
    loop = FakeLoop(make_kv(1024, max_running=16), max_running=16, prefill_step_tokens=10, chunked_prefill_size=-1)
    loop.submit(*[make_req(f"r{i}", [30 + i] * 8, max_new_tokens=3) for i in range(5)])
    first = loop.step()
    assert [r.rid for r in first.reqs] == ["r0", "r1"] and first.extend_lens == [8, 8]
    second = loop.step()                                    # two decodes, then the next two prompts
    assert [r.rid for r in second.reqs] == ["r0", "r1", "r2", "r3"] and second.extend_lens == [1, 1, 8, 8]
    loop.submit(make_req("long", list(range(3, 40)), max_new_tokens=2))
    loop.step()                                             # r4 (8 tokens), then the long one too
    assert loop.batches[-1].extend_lens[-2:] == [8, 37]    # below the target the next one comes whole
    loop.run()
    assert loop.kv.is_fully_free() and len(loop.finished) == 6
    off = FakeLoop(make_kv(1024, max_running=16), max_running=16, prefill_step_tokens=0, chunked_prefill_size=-1)
    off.submit(*[make_req(f"r{i}", [30 + i] * 8, max_new_tokens=3) for i in range(5)])
    assert off.step().extend_lens == [8] * 5


def test_decode_tokens_count_against_max_prefill_tokens() -> None:
    """A step is at most --max-prefill-tokens rows, decodes included; prompts keep a quarter of it."""
    loop = FakeLoop(make_kv(1024, max_running=16), max_running=16, max_prefill_tokens=40, chunked_prefill_size=-1)
    loop.submit(*[make_req(f"d{i}", [30 + i] * 4, max_new_tokens=20) for i in range(6)])
    loop.step()                                             # 24 prompt tokens: all six admitted
    loop.submit(make_req("long", list(range(3, 60)), max_new_tokens=2))
    batch = loop.step()
    assert batch.extend_lens == [1] * 6 + [34]              # 40 rows in all
    loop.submit(*[make_req(f"e{i}", [50 + i] * 4, max_new_tokens=20) for i in range(8)])
    loop.run()
    loop2 = FakeLoop(make_kv(8192, max_running=64), max_running=64, max_prefill_tokens=40, chunked_prefill_size=-1)
    loop2.submit(*[make_req(f"d{i}", [30 + i] * 2, max_new_tokens=50) for i in range(36)])
    while loop2.waiting:
        loop2.step()
    assert len(loop2.running) == 36                         # 36 decodes running
    loop2.submit(make_req("late", list(range(3, 40)), max_new_tokens=2))
    batch = loop2.step()
    assert batch.extend_lens[-1] == 10                      # a quarter of 40, not 40 - 36
    loop2.run()


def test_total_token_budget_holds_back_requests_until_memory_frees() -> None:
    kv = make_kv(64)
    loop = FakeLoop(kv)
    loop.submit(*[make_req(f"r{i}", [40 + i] * 20, max_new_tokens=10) for i in range(4)])
    first = loop.step()
    assert 1 <= len(first.reqs) < 4 and loop.waiting
    loop.run()
    assert len(loop.finished) == 4


# ------------------------------------------------------------------ chunked prefill
def test_chunked_prefill_splits_a_long_prompt() -> None:
    loop = FakeLoop(make_kv(512), chunked_prefill_size=8)
    req = make_req("long", list(range(3, 23)), max_new_tokens=2)
    loop.submit(req)
    lens = [loop.step().extend_lens for _ in range(3)]
    assert lens == [[8], [8], [4]]
    assert len(req.output_ids) == 1
    loop.run()


def test_chunk_runs_alongside_decodes_and_is_page_aligned() -> None:
    loop = FakeLoop(make_kv(512, page_size=4), chunked_prefill_size=6)
    short = make_req("short", [7, 8, 9], max_new_tokens=6)
    loop.submit(short)
    loop.step()
    long = make_req("long", list(range(3, 20)), max_new_tokens=2)
    loop.submit(long)
    batch = loop.step()
    assert batch.reqs == [short, long] and batch.extend_lens == [1, 4]   # chunk of 6 cut to a page
    assert len(long.prefix_indices) == 4 and loop.kv.protected_tokens() >= 4   # the chunk is cached and locked
    loop.run()


# ------------------------------------------------------------------ in-batch prefix sharing
def test_second_request_with_the_same_long_prefix_waits_one_step_and_hits() -> None:
    shared = list(range(3, 60))
    a, b = make_req("a", shared + [1], max_new_tokens=2), make_req("b", shared + [2], max_new_tokens=2)
    loop = FakeLoop(make_kv(512))
    loop.submit(a, b)
    first = loop.step()
    assert first.reqs == [a] and loop.waiting == [b]
    second = loop.step()
    assert b in second.reqs and b.cached_tokens == len(shared)
    loop.run()
    stats = loop.planner.stats()
    assert stats.prefix_cache_hits == len(shared) and stats.prefix_cache_queries == 2 * (len(shared) + 1)


def test_without_radix_cache_nothing_is_deferred_or_shared() -> None:
    shared = list(range(3, 60))
    loop = FakeLoop(make_kv(512, disable_radix_cache=True), disable_radix_cache=True)
    a, b = make_req("a", shared + [1], max_new_tokens=2), make_req("b", shared + [2], max_new_tokens=2)
    loop.submit(a, b)
    assert loop.step().reqs == [a, b]
    loop.run()
    assert a.cached_tokens == b.cached_tokens == 0 and loop.kv.prefix_cache.total_size() == 0


# ------------------------------------------------------------------ preemption
def _outputs(loop: FakeLoop) -> dict[str, list[int]]:
    return {r.rid: r.output_ids for r in loop.finished}


def test_preemption_retracts_and_recomputes_with_the_same_outputs() -> None:
    reqs = lambda: [make_req(f"r{i}", [50 + i] * 10, max_new_tokens=30) for i in range(4)]  # noqa: E731
    roomy = FakeLoop(make_kv(512))
    roomy.submit(*reqs())
    roomy.run()
    assert roomy.planner.stats().num_preemptions == 0
    tight = FakeLoop(make_kv(80), schedule_conservativeness=0.0)
    tight.submit(*reqs())
    tight.run()
    assert tight.planner.stats().num_preemptions > 0
    assert any(r.num_preemptions for r in tight.finished)
    assert _outputs(tight) == _outputs(roomy)


def test_retracted_request_goes_to_the_front_without_kv() -> None:
    loop = FakeLoop(make_kv(48), schedule_conservativeness=0.0)
    reqs = [make_req(f"r{i}", [60 + i] * 10, max_new_tokens=30) for i in range(3)]   # each fits alone
    loop.submit(*reqs)
    while not loop.planner.stats().num_preemptions:
        loop.step()
    victim = loop.waiting[0]
    assert victim.num_preemptions == 1 and victim.req_pool_idx is None and victim.kv_committed_len == 0
    assert victim.last_node is None and len(victim.prefix_indices) == 0
    loop.run()
    assert len(loop.finished) == 3
    assert victim.cached_tokens == 0    # re-admission may hit its own old KV; that is not reported


def test_prefill_steps_teach_the_pace_their_time() -> None:
    """A step's prompt rows are counted in the batch (decodes are not); auto follows the planner's
    measured pace."""
    loop = FakeLoop(make_kv(1024, max_running=16), max_running=16, prefill_step_tokens=-1, chunked_prefill_size=-1)
    loop.submit(*[make_req(f"r{i}", [30 + i] * 8, max_new_tokens=3) for i in range(3)])
    first = loop.step()
    assert first.prompt_tokens == 24 and loop.planner.pace.target() == 512
    loop.planner.pace.observe(rows=1000, seconds=1000 * 0.3 / 200)
    assert loop.planner.pace.target() == 192
    assert loop.step().prompt_tokens == 0              # decodes only
    loop.run()
