"""SplitChoice: whether a CPU decode step runs the one-call decoder whole or split, by timing both.

`Decoder.forward_split` (kernels/cpu_decoder/decoder.cpp) gives each thread a run of the batch's
requests to take through every layer alone, so a step has no barrier between ops. On a 2-core Zen 4
with SmolLM2-135M that made decode steps 6-11% faster at batch 32-64 with 384-token contexts, and
slower with 1,024-token contexts (the memory-bound attention streams slower from one thread), and
changed nothing for a 0.5B model. Which way wins depends on the model, the batch, the contexts and
the machine, so it is measured where it runs: per (threads, batch size, mean context) bucket, the
sizes rounded down to powers of two, the first steps alternate the two ways until each has TRIALS
timings; then the lower median wins, and every RECHECK-th step of the bucket tries the other way
again (the last TRIALS timings of each way count). The first WARMUP steps of each way in the process
are not counted (the first split steps were up to 30% slower: the second thread's allocations).
Both ways compute the same bits, so a trial never changes an output.

    choice = SplitChoice("auto")
    parts, key = choice.parts_for(threads, batch_size, mean_context)   # 1: the whole batch at once
    ... run the step, timing it ...
    choice.record(key, parts, seconds)

`--cpu-decode-split off|on` / `RADIXLM_CPU_DECODE_SPLIT` turns the trials off or forces the split.
"""

from __future__ import annotations

import statistics
from collections import deque

TRIALS = 5          # timings of each way per bucket before a choice (and kept after it)
RECHECK = 64        # every RECHECK-th step of a bucket runs the losing way once more
WARMUP = 2          # the first steps of each way in a process are not counted
MIN_ROWS = 8        # a split gives each thread at least this many requests


class SplitChoice:
    def __init__(self, mode: str = "auto"):
        self.mode = mode                            # "auto", "on" or "off"
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._warmup = [WARMUP, WARMUP]             # [whole, split] steps still to leave uncounted

    def parts_for(self, threads: int, batch_size: int, mean_context: float) -> tuple[int, tuple | None]:
        """(parts: 1 runs the batch whole, else one part per thread; the bucket to record the step's
        time under, or None when nothing is being measured)."""
        if self.mode == "off" or threads < 2 or batch_size < threads * MIN_ROWS:
            return 1, None
        if self.mode == "on":
            return threads, None
        key = (threads, batch_size.bit_length(), int(mean_context).bit_length())
        bucket = self._buckets.setdefault(key, _Bucket())
        return (threads if bucket.next_is_split() else 1), key

    def record(self, key: tuple | None, parts: int, seconds: float) -> None:
        if key is None:
            return
        split = int(parts > 1)
        if self._warmup[split] > 0:
            self._warmup[split] -= 1
        else:
            self._buckets[key].times[split].append(seconds)

    def chosen(self) -> dict[tuple, str]:
        """The current winner of each bucket that has one: {(threads, batch bits, context bits): "split"|"whole"}."""
        return {k: ("split" if b.split_wins() else "whole") for k, b in self._buckets.items() if b.decided()}


class _Bucket:
    def __init__(self) -> None:
        self.times = (deque(maxlen=TRIALS), deque(maxlen=TRIALS))   # [whole, split] step seconds
        self.tried = [0, 0]                                          # [whole, split] steps run before a choice
        self.steps = 0

    def decided(self) -> bool:
        return all(len(t) == TRIALS for t in self.times)

    def split_wins(self) -> bool:
        return statistics.median(self.times[1]) < statistics.median(self.times[0])

    def next_is_split(self) -> bool:
        self.steps += 1
        if not self.decided():                      # alternate, the whole batch first
            split = self.tried[1] < self.tried[0]
            self.tried[split] += 1
            return split
        return self.split_wins() != (self.steps % RECHECK == 0)
