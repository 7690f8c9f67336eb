"""ThreadAdapter: fewer torch threads while other processes keep a core busy.

    adapter = ThreadAdapter(torch.get_num_threads())
    adapter.tick(step_s)    # after each scheduler step (it took step_s); looks at the load every INTERVAL_S
    adapter.idle()          # while idle, and as a burst begins: may only give a dropped thread back

OpenMP threads wait for each other at the end of every parallel region, spinning first. When another
process holds one of the cores, the thread it displaced finishes each region late and the others spin
through their time slices: on a 2-core Xeon a decode step at batch 16 went from 29 ms to 300 ms beside
one busy process, against 48 ms with one thread. Waiting passively (OMP_WAIT_POLICY=PASSIVE) bounds that
too but costs 50% on a quiet machine (43 ms), so the spinning stays and the thread count adapts: when
other processes took at least DROP_SHARE of all cores over DROP_AFTER_S or more of stepping in a row,
one thread fewer (at least one); when they took at most RESTORE_SHARE, back up to the configured count.
The log says when. One busy half-second interval is not enough: the server's own HTTP process starting up (or the
client of a benchmark loading its tokenizer) took 53-54% for one interval at every start on a Zen 5
EPYC, and the one thread it cost then stayed for the next ~6 s of serving, since the HTTP and
detokenizer processes streaming tokens kept the others' share between the two thresholds. The time
counts, not the looks: beside a busy process one 2,048-token prefill step took 6 s (10x its quiet
time) and the next look came only after it; counted as one interval it needed a second slow step.

Only an interval the scheduler spent stepping (MIN_STEPPING of its wall time or more) can cost a
thread: a neighbour that computes while this server waits for requests slows nothing down. A
side-by-side benchmark alternates short greedy requests between two servers before its timed runs;
each of this server's looks then spanned the other server's request (57% of the cores), the thread
went after two of them, and the first timed run prefilled its first wave on one thread (3 s on a
Zen 5 EPYC) before a quiet interval brought it back. A mostly idle interval may still restore the
threads (the others were quiet) and restarts the count of busy ones. With a thread dropped, the idle
scheduler looks too (`idle()`: every 0.25 s, and once more right before a burst's first step, over
0.1 s or more), and only to give it back: otherwise the first look after a drop came after the next
burst's first step. On a Zen 4 EPYC a thread dropped while the other server of a side-by-side
benchmark really spun beside this one's greedy check came back only after the first timed run's first
2,048-token prefill, which ran on one thread (2 s instead of 1.2): the benchmark starts a run 0.25 s
after the machine goes quiet, less than one INTERVAL_S.

"Other processes" are those outside this server: the CPU time of the scheduler's parent (the HTTP
and tokenizer process) and of its children (the detokenizer, other ranks) counts as the scheduler's
own (`ServerFamily`). Counted as others, the HTTP and detokenizer processes streaming tokens (with a
benchmark client: 9-10% of both cores at concurrency 16 on a Zen 5 EPYC) sat at the restore
threshold, so a thread dropped for a real neighbour (another server computing for 2 s) came back
only seconds after the neighbour had stopped: every first benchmark run after such a burst paid it.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ..layers import neighbour_load

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5
MIN_STEPPING = 0.8         # share of an interval spent in steps for its load to count against a thread
DROP_SHARE = 0.25          # others' share of all cores (a half-busy core out of 2) that costs a thread
RESTORE_SHARE = 0.10
DROP_AFTER_S = 1.0         # seconds of consecutive busy stepping intervals before a thread is dropped
IDLE_INTERVAL_S = 0.1      # the shortest interval an idle look (restore only) judges


class ThreadAdapter:
    """`clock` gates the look at the load (a /proc/stat read), so a step between looks costs one
    clock read; `sampler` gives (wall s, own CPU s, busy_seconds()) as neighbour_load.sample does."""

    def __init__(self, threads: int, sampler=None, clock=time.perf_counter):
        self.max_threads = threads
        self.threads = threads
        self._sample, self._clock = sampler or ServerFamily().sample, clock
        self._last = self._sample()
        self._stepped = 0.0        # seconds spent in steps since the last look
        self._busy_s = 0.0         # seconds of consecutive stepping intervals with the others' share >= DROP_SHARE

    def tick(self, step_s: float) -> None:
        """After a step that took `step_s`: checks the load once INTERVAL_S has passed since the last
        check and adapts the thread count."""
        self._stepped += step_s
        if self.max_threads < 2 or self._clock() - self._last[0] < INTERVAL_S:
            return
        self._look(may_drop=True)

    def idle(self) -> None:
        """While the scheduler waits for requests, and once more as a burst begins: with a thread
        dropped, a look over IDLE_INTERVAL_S or more that may give it back (and never takes one)."""
        if self.held_back() and self._clock() - self._last[0] >= IDLE_INTERVAL_S:
            self._look(may_drop=False)

    def _look(self, may_drop: bool) -> None:
        now = self._sample()
        share = neighbour_load.others_share(self._last, now)
        wall = now[0] - self._last[0]
        stepping = self._stepped >= MIN_STEPPING * wall
        self._last, self._stepped = now, 0.0
        if share is None:
            self._busy_s = 0.0
            return
        self._busy_s = self._busy_s + wall if share >= DROP_SHARE and stepping and may_drop else 0.0
        if self._busy_s >= DROP_AFTER_S and self.threads > 1:
            self._set(self.threads - 1, share, wall)
        elif share <= RESTORE_SHARE and self.threads < self.max_threads:
            self._set(self.max_threads, share, wall)

    def held_back(self) -> bool:
        """Whether a thread is dropped now."""
        return self.threads < self.max_threads

    def _set(self, threads: int, share: float, wall: float) -> None:
        logger.info("Other processes used %.0f%% of the cores over the last %.1f s%s: torch threads %d -> %d",
                    100 * share, wall, f" ({self._busy_s:.1f} s busy in a row)" if threads < self.threads else "",
                    self.threads, threads)
        self.threads = threads
        torch.set_num_threads(threads)


class ServerFamily:
    """CPU seconds of this process plus its parent and the parent's other children (this server's
    HTTP, detokenizer and other scheduler processes), for ThreadAdapter's `sampler`. Each look lists
    the children again; a process counts from its first look, and one that exits takes its seconds
    with it from the next look on (only its last interval is lost), so the sum never steps back."""

    def __init__(self, parent: int | None = None, proc: str = "/proc"):
        self.parent = os.getppid() if parent is None else parent
        self.proc = proc
        self._seen: dict[int, float] = {}
        self._total = 0.0

    def sample(self) -> neighbour_load.Sample:
        wall, own, busy = neighbour_load.sample()
        return wall, own + self.seconds(), busy

    def seconds(self) -> float:
        """Summed CPU seconds of the family (this process excluded) gained since the first look."""
        now: dict[int, float] = {}
        for pid in self._members():
            cpu = self._cpu(pid)
            if cpu is not None:
                now[pid] = cpu
                self._total += cpu - self._seen.get(pid, cpu)
        self._seen = now
        return self._total

    def _members(self) -> set[int]:
        if self.parent <= 1:                 # orphaned or run directly: no server around this process
            return set()
        pids = {self.parent}
        try:
            for task in os.listdir(f"{self.proc}/{self.parent}/task"):
                with open(f"{self.proc}/{self.parent}/task/{task}/children") as f:
                    pids.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            pass
        pids.discard(os.getpid())
        return pids

    def _cpu(self, pid: int) -> float | None:
        """utime + stime of `pid` in seconds (/proc/PID/stat), None if it is gone."""
        try:
            with open(f"{self.proc}/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / neighbour_load.TICKS_PER_S
        except (OSError, ValueError, IndexError):
            return None
