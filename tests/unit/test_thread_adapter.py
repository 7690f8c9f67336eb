"""ThreadAdapter: one torch thread fewer while other processes keep a core busy, back when they stop.
(Beside one busy process a 2-core decode step went from 29 ms to 300 ms with both threads spinning;
48 ms with one.) Samples are scripted: (wall s, own CPU s, (machine busy s, cores))."""

from __future__ import annotations

import torch

from radixlm.runtime.managers import thread_adapter as ta


class Script:
    """Scripted load: each tick's clock read moves to the next sample (its wall time); the sampler,
    the /proc/stat read, returns that sample and is counted in `looks`."""

    def __init__(self, samples):
        self._it = iter(samples)
        self._current = next(self._it)
        self.looks = 0

    def clock(self) -> float:
        self._current = next(self._it)
        return self._current[0]

    def sampler(self):
        self.looks += 1
        return self._current


def adapter_over(threads: int, samples, script: Script | None = None) -> ta.ThreadAdapter:
    script = script or Script(samples)
    return ta.ThreadAdapter(threads, script.sampler, script.clock)


def test_drops_a_thread_under_a_busy_neighbour_and_restores_when_it_stops(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    samples = [
        (0.0, 0.0, (0.0, 2)),
        (0.2, 0.4, (0.4, 2)),       # under INTERVAL_S: not looked at
        (0.6, 1.0, (1.6, 2)),       # others 0.6 s of 1.2 core-s = 50%: one busy interval, kept
        (1.2, 1.6, (2.8, 2)),       # busy again (DROP_WINDOWS in a row): 2 -> 1
        (1.8, 2.2, (3.45, 2)),      # others 0.05 s of 1.2 = 4%: back to 2
        (2.4, 2.8, (4.1, 2)),       # quiet at 2 threads: nothing to do
    ]
    script = Script(samples)
    adapter = adapter_over(2, samples, script)
    threads = []
    for _ in samples[1:]:
        adapter.tick()
        threads.append(adapter.threads)
    assert threads == [2, 2, 1, 2, 2] and calls == [1, 2]
    assert script.looks == 5          # the first sample and 4 looks: the tick under INTERVAL_S read no load


def test_one_thread_never_adapts_and_unreadable_load_changes_nothing(monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (_ for _ in ()).throw(AssertionError(n)))
    single = adapter_over(1, [(0.0, 0.0, (0.0, 2)), (1.0, 0.0, (2.0, 2))])
    single.tick()
    blind = adapter_over(2, [(0.0, 0.0, None), (1.0, 0.0, None)])
    blind.tick()
    assert single.threads == 1 and blind.threads == 2


def test_a_window_across_an_idle_gap_decides_nothing(monkeypatch) -> None:
    """Ticks come after steps; after an idle scheduler the window spans whatever else ran meanwhile
    (in a side-by-side benchmark, the other server's whole run) and must not cost this run a thread."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (_ for _ in ()).throw(AssertionError(n)))
    samples = [(0.0, 0.0, (0.0, 2)), (30.0, 0.1, (50.0, 2)), (30.6, 0.7, (50.65, 2))]
    adapter = adapter_over(2, samples)
    adapter.tick()                  # 30 s since the last look, others took 83%: stale, ignored
    adapter.tick()                  # a fresh 0.6 s window: others 0.05 s of 1.2 = 4%, nothing to do
    assert adapter.threads == 2


def test_one_busy_interval_between_quiet_ones_keeps_the_threads(monkeypatch) -> None:
    """A start-up burst (the server's own HTTP process, a client loading its tokenizer) took 53% for
    one interval at every start; it must not cost a thread for the seconds after it."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    samples = [
        (0.0, 0.0, (0.0, 2)),
        (0.6, 1.2, (1.85, 2)),      # others 0.65 s of 1.2 = 54%: one busy interval
        (1.2, 2.4, (3.1, 2)),       # others 0.05 s: quiet
        (1.8, 3.0, (3.95, 2)),      # others 0.25 s of 1.2 = 21%: between the thresholds
        (2.4, 3.6, (4.95, 2)),      # busy (33%), once
    ]
    adapter = adapter_over(2, samples)
    for _ in samples[1:]:
        adapter.tick()
    assert adapter.threads == 2 and calls == []
