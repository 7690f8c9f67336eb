"""runtime/model_executor/decode_split.SplitChoice: whole or split CPU decode steps, chosen by timing
both per (threads, batch, context) bucket. Timings are given here, not measured."""

from __future__ import annotations

from radixlm.runtime.model_executor.decode_split import RECHECK, TRIALS, WARMUP, SplitChoice


def test_alternates_then_keeps_the_faster_way_and_follows_a_change() -> None:
    choice = SplitChoice("auto")
    assert choice.parts_for(2, 15, 300.0) == (1, None)       # under 8 requests a thread: whole, not timed
    assert choice.parts_for(1, 64, 300.0) == (1, None)       # one thread: nothing to split
    cost = {1: 0.07, 2: 0.05}
    seen = []
    for step in range(3 * RECHECK):
        parts, key = choice.parts_for(2, 40, 300.0)
        seen.append(parts)
        warm = step < 2 * WARMUP                              # slow first steps: not counted
        choice.record(key, parts, 1.0 if warm and parts == 2 else cost[parts])
    trials = 2 * (WARMUP + TRIALS)
    assert seen[:trials] == [1, 2] * (WARMUP + TRIALS)        # trials alternate, the whole batch first
    assert choice.chosen() == {(2, 6, 9): "split"}            # 40 -> 2**5 bucket, 300 -> 2**8
    rechecks = [i + 1 for i, p in enumerate(seen) if p == 1 and i >= trials]
    assert rechecks == [RECHECK, 2 * RECHECK, 3 * RECHECK]    # the losing way, once every RECHECK steps

    cost[2] = 0.09                                            # the split turns slower (longer contexts...)
    after = []
    for _ in range(TRIALS + 1):
        parts, key = choice.parts_for(2, 40, 300.0)
        after.append(parts)
        choice.record(key, parts, cost[parts])
    flip = TRIALS // 2 + 1                                    # slower timings until they are the median
    assert after == [2] * flip + [1] * (TRIALS + 1 - flip) and choice.chosen() == {(2, 6, 9): "whole"}
    assert choice.parts_for(2, 40, 600.0)[1] == (2, 6, 10)   # another context bucket: its own trials


def test_forced_ways_are_not_timed() -> None:
    assert SplitChoice("off").parts_for(2, 64, 100.0) == (1, None)
    assert SplitChoice("on").parts_for(4, 64, 100.0) == (4, None)
    assert SplitChoice("on").parts_for(4, 31, 100.0) == (1, None)   # 8 requests a thread at least
