"""NeighbourLoad: other processes' share of the cores over a block, the signal that decides whether
kernel timings are kept. This process's own CPU share was the old signal; on an idle AMX Xeon a
oneDNN call kept one of two threads busy, so every timing looked disturbed and none was cached."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from radixlm.runtime.layers import linear_select as ls
from radixlm.runtime.layers import neighbour_load as nl


def test_share_is_others_busy_time_over_all_cores(monkeypatch) -> None:
    readings = iter([(100.0, 2), (100.9, 2)])            # 0.9 CPU s busy machine-wide over the block
    clock = iter([0.0, 1.0])                             # 1 s of wall time
    cpu = iter([5.0, 5.5])                               # of which this process used 0.5 s
    monkeypatch.setattr(nl, "busy_seconds", lambda: next(readings))
    monkeypatch.setattr(nl.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(nl.time, "process_time", lambda: next(cpu))
    with nl.NeighbourLoad() as load:
        pass
    assert load.share == pytest.approx(0.4 / 2)


def test_unreadable_proc_stat_gives_no_share(monkeypatch) -> None:
    monkeypatch.setattr(nl, "busy_seconds", lambda: None)
    with nl.NeighbourLoad() as load:
        pass
    assert load.share is None


def test_a_spinning_neighbour_is_seen_and_its_timings_are_not_clean() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with nl.NeighbourLoad() as load:
            time.sleep(0.5)                              # this process idles; the neighbour runs
        assert load.share is not None and load.share > ls.NEIGHBOUR_SHARE
        t = ls.time_passes({"sleep": lambda: time.sleep(0.001)}, 1, 2, 4, float("inf"))
        assert t["sleep"].clean == 0 and t["sleep"].any_us < float("inf")
    finally:
        spin.kill()
        spin.wait()


def test_quiet_blocks_count_their_passes(monkeypatch) -> None:
    class Quiet(nl.NeighbourLoad):
        def __exit__(self, *exc) -> None:
            self.share = 0.0

    monkeypatch.setattr(ls, "NeighbourLoad", Quiet)
    t = ls.time_passes({"a": lambda: None, "b": lambda: None}, 1, 3, 8, float("inf"))
    assert all(p.clean >= 3 and p.clean_us <= p.any_us for p in t.values())
