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
        (1.2, 1.6, (2.8, 2)),       # busy again (DROP_AFTER_S of stepping in a row): 2 -> 1
        (1.8, 2.2, (3.45, 2)),      # others 0.05 s of 1.2 = 4%: back to 2
        (2.4, 2.8, (4.1, 2)),       # quiet at 2 threads: nothing to do
    ]
    script = Script(samples)
    adapter = adapter_over(2, samples, script)
    threads = []
    for prev, cur in zip(samples, samples[1:]):
        adapter.tick(cur[0] - prev[0])          # stepping all the time
        threads.append(adapter.threads)
    assert threads == [2, 2, 1, 2, 2] and calls == [1, 2]
    assert script.looks == 5          # the first sample and 4 looks: the tick under INTERVAL_S read no load


def test_one_thread_never_adapts_and_unreadable_load_changes_nothing(monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (_ for _ in ()).throw(AssertionError(n)))
    single = adapter_over(1, [(0.0, 0.0, (0.0, 2)), (1.0, 0.0, (2.0, 2))])
    single.tick(1.0)
    blind = adapter_over(2, [(0.0, 0.0, None), (1.0, 0.0, None)])
    blind.tick(1.0)
    assert single.threads == 1 and blind.threads == 2


def test_a_window_across_an_idle_gap_decides_nothing(monkeypatch) -> None:
    """Ticks come after steps; after an idle scheduler the window spans whatever else ran meanwhile
    (in a side-by-side benchmark, the other server's whole run) and must not cost this run a thread."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (_ for _ in ()).throw(AssertionError(n)))
    samples = [(0.0, 0.0, (0.0, 2)), (30.0, 0.1, (50.0, 2)), (30.6, 0.7, (50.65, 2))]
    adapter = adapter_over(2, samples)
    adapter.tick(0.1)               # 30 s since the last look, others took 83%, but this server idled
    adapter.tick(0.6)               # a stepping 0.6 s window: others 0.05 s of 1.2 = 4%, nothing to do
    assert adapter.threads == 2


def test_a_neighbour_busy_only_while_this_server_waits_costs_no_thread(monkeypatch) -> None:
    """Two servers taking turns (a side-by-side benchmark's greedy check): in every interval this one
    stepped 0.25 s and waited while the other computed, which took 57% of the cores. That is no
    contention, and the first timed run must start with every thread; the same load while stepping
    throughout drops one."""
    samples = [(0.6 * i, 0.5 * i, (0.5 * i + 0.684 * i, 2)) for i in range(6)]   # others 0.684 of 1.2 s
    for step_s, want in ((0.25, []), (0.6, [1])):
        calls: list[int] = []
        monkeypatch.setattr(torch, "set_num_threads", calls.append)
        adapter = adapter_over(2, samples)
        for _ in samples[1:]:
            adapter.tick(step_s)
        assert calls == want, (step_s, calls)


def test_idle_looks_give_a_dropped_thread_back_and_never_take_one(monkeypatch) -> None:
    """idle() (the waiting event loop, and the start of a burst): with a thread dropped, a quiet
    interval of IDLE_INTERVAL_S or more restores it before the next burst's first step (which used to
    run on one thread); a busy one, however long, drops nothing; at full threads it reads no load."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    samples = [
        (0.0, 0.0, (0.0, 2)),
        (0.6, 0.6, (1.8, 2)),       # stepping, others 0.6 of 1.2 = 50%
        (1.2, 1.2, (3.6, 2)),       # again (DROP_AFTER_S in a row): 2 -> 1
        (1.25, 1.2, (3.7, 2)),      # idle, under IDLE_INTERVAL_S: not looked at
        (2.2, 1.2, (5.4, 2)),       # idle, the neighbour still spins (90%): no change
        (4.2, 1.2, (8.4, 2)),       # idle and busy: an idle look never drops a thread
        (4.35, 1.2, (8.405, 2)),    # 0.15 s idle and quiet (2%): back to 2 before any step
        (9.0, 1.2, (9.0, 2)),       # at full threads: no look
    ]
    script = Script(samples)
    adapter = adapter_over(2, samples, script)
    adapter.tick(0.6)
    adapter.tick(0.6)
    assert calls == [1]
    adapter.idle()
    adapter.idle()
    adapter.idle()
    assert calls == [1] and adapter.threads == 1 and script.looks == 5
    adapter.idle()
    assert calls == [1, 2] and adapter.threads == 2
    adapter.idle()
    assert script.looks == 6


def test_one_long_busy_step_is_enough(monkeypatch) -> None:
    """Beside a busy process a prefill step took 6 s and the next look came after it: that interval
    alone is DROP_AFTER_S of contention (a 0.6 s one is not, see the next test)."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    samples = [(0.0, 0.0, (0.0, 2)), (6.0, 6.2, (11.98, 2))]    # others 5.78 of 12 core-s = 48%
    adapter = adapter_over(2, samples)
    adapter.tick(6.0)
    assert calls == [1]


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
        adapter.tick(0.6)
    assert adapter.threads == 2 and calls == []


def write_proc(root, parent: int, children: list[int], cpu_ticks: dict[int, int]) -> None:
    """A fake /proc: the parent's task lists `children`, each pid's stat has utime = its ticks."""
    task = root / str(parent) / "task" / str(parent)
    task.mkdir(parents=True, exist_ok=True)
    (task / "children").write_text(" ".join(map(str, children)) + " ")
    for pid in [parent, *children]:
        stat = root / str(pid) / "stat"
        if pid in cpu_ticks:
            stat.parent.mkdir(parents=True, exist_ok=True)
            stat.write_text(f"{pid} (py thon) S 1 1 1 0 -1 0 0 0 0 0 {cpu_ticks[pid]} 0 0 0 20 0 1 0\n")
        elif stat.exists():
            stat.unlink()


def test_server_family_counts_parent_and_siblings_and_never_steps_back(tmp_path) -> None:
    tick = ta.neighbour_load.TICKS_PER_S
    family = ta.ServerFamily(parent=10, proc=str(tmp_path))
    write_proc(tmp_path, 10, [20, 30], {10: 100, 20: 50, 30: 7})
    assert family.seconds() == 0.0                       # the first look sets the baselines
    write_proc(tmp_path, 10, [20, 30, 40], {10: 130, 20: 60, 30: 7, 40: 500})
    assert abs(family.seconds() - 40 / tick) < 1e-9      # 40 joined now: only its later ticks count
    write_proc(tmp_path, 10, [30, 40], {10: 130, 30: 9, 40: 510})   # 20 exited
    assert abs(family.seconds() - 52 / tick) < 1e-9
    assert ta.ServerFamily(parent=1, proc=str(tmp_path)).seconds() == 0.0   # no server around


def test_server_family_reads_a_real_busy_child() -> None:
    """The adapter's sampler counts this server's processes as its own: a busy child of the parent
    (here: of this test process) adds its CPU time to `own`, so it is not taken for a neighbour."""
    import os
    import subprocess
    import sys

    family = ta.ServerFamily(parent=os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.4: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        family.seconds()
        import time
        time.sleep(1.0)
        gained = family.seconds()
    finally:
        child.communicate(b"\n", timeout=10)
    assert 0.2 < gained < 1.2, gained


def test_own_server_processes_do_not_hold_a_thread_back(monkeypatch, tmp_path) -> None:
    """After a real neighbour left, the HTTP and detokenizer processes streaming tokens (here 20% of
    the cores) must not keep the dropped thread away: ServerFamily counts them as the scheduler's own.
    The same load with the plain sampler (everything but this process is a neighbour) keeps 1 thread."""
    tick = ta.neighbour_load.TICKS_PER_S
    machine = [  # (wall s, this process's CPU s, machine busy s); the family's ticks below
        (0.0, 0.0, 0.0),
        (0.6, 0.6, 1.2),        # a neighbour: others 0.6 of 1.2 = 50%
        (1.2, 1.2, 2.4),        # again: 2 -> 1
        (1.8, 1.8, 3.24),       # neighbour gone: 1 thread (0.6 s) + the family's 0.24 s (20%)
        (2.4, 3.0, 4.68),       # 2 threads (1.2 s) + the family's 0.24 s
    ]
    family_ticks = [0, 0, 0, round(0.24 * tick), round(0.48 * tick)]

    def run(with_family: bool) -> list[int]:
        calls: list[int] = []
        monkeypatch.setattr(torch, "set_num_threads", calls.append)
        step = iter(range(len(machine)))
        state = {"i": 0}

        def plain():
            wall, own, busy = machine[state["i"]]
            return wall, own, (busy, 2)

        def clock():
            state["i"] = next(step)
            write_proc(tmp_path, 10, [20], {10: 0, 20: family_ticks[state["i"]]})
            return machine[state["i"]][0]

        clock()
        if with_family:
            monkeypatch.setattr(ta.neighbour_load, "sample", plain)
            sampler = ta.ServerFamily(parent=10, proc=str(tmp_path)).sample
        else:
            sampler = plain
        adapter = ta.ThreadAdapter(2, sampler, clock)
        for _ in machine[1:]:
            adapter.tick(0.6)
        return calls

    assert run(with_family=True) == [1, 2]
    assert run(with_family=False) == [1]


def test_default_sampler_is_the_server_family() -> None:
    adapter = ta.ThreadAdapter(2)
    wall, own, busy = adapter._last
    assert wall > 0 and own >= 0 and (busy is None or busy[1] >= 1)
    assert adapter._sample.__self__.__class__ is ta.ServerFamily
