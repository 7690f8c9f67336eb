"""The scheduler process's receive loop: how long it waits on its socket in each state (an idle
server and one whose only work is compiling grammars must not spin)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import zmq

from radixlm.runtime.managers import scheduler_process
from radixlm.runtime.managers.ipc import Puller


class _Stop(Exception):
    pass


class FakeScheduler:
    """The loop's view of a scheduler: lists it reads, and a step() counter."""

    def __init__(self, waiting: list, running: list, compiling: list, seconds: float):
        self.waiting, self.running, self.compiling = waiting, running, compiling
        self.args = SimpleNamespace(tp_size=1)
        self.steps = 0
        self.deadline = time.monotonic() + seconds

    def has_work(self) -> bool:
        if time.monotonic() > self.deadline:
            raise _Stop
        return bool(self.waiting or self.running or self.compiling)

    def handle(self, msg) -> None:
        pass

    def step(self) -> None:
        self.steps += 1

    def timeout_aborts(self) -> list:
        return []

    def drain_step_times(self) -> list:
        return []


def loop_for(sched: FakeScheduler, puller: Puller) -> int:
    with pytest.raises(_Stop):
        scheduler_process.event_loop(sched, puller)
    return sched.steps


def test_loop_waits_on_its_socket_while_only_grammars_compile(tmp_path):
    ctx = zmq.Context()
    puller = Puller(ctx, f"ipc://{tmp_path}/sched")
    try:
        compiling = loop_for(FakeScheduler([], [], ["grammar"], seconds=0.2), puller)
        busy = loop_for(FakeScheduler(["req"], [], [], seconds=0.2), puller)
    finally:
        puller.close()
        ctx.term()
    # 0.2 s in GRAMMAR_POLL_MS slices is at most ~40 steps; a spinning loop makes thousands
    assert compiling <= 0.2 * 1000 / scheduler_process.GRAMMAR_POLL_MS + 2, compiling
    assert busy > 10 * compiling            # with requests to run it does not wait at all


class RecordingAdapter:
    def __init__(self, held_back: bool = False):
        self.ticks: list[float] = []
        self._held_back = held_back

    def tick(self, step_s: float) -> None:
        self.ticks.append(step_s)

    def idle(self) -> None:
        self.ticks.append(0.0)

    def held_back(self) -> bool:
        return self._held_back


class BurstScheduler(FakeScheduler):
    """Idle at the loop's first look; a request arrives while it waits and stays."""

    def __init__(self, seconds: float):
        super().__init__([], [], [], seconds)
        self._looked = False

    def has_work(self) -> bool:
        if not self._looked:
            self._looked = True
            self.waiting = ["req"]
            return False
        return super().has_work()


def test_idle_loop_ticks_the_thread_adapter(tmp_path, monkeypatch):
    """An idle server looks at the load too (idle() once per poll, and as a burst begins), so a thread
    dropped for a neighbour comes back while it waits, not after the next burst's first step."""
    monkeypatch.setattr(scheduler_process, "IDLE_POLL_MS", 10)
    ctx = zmq.Context()
    puller = Puller(ctx, f"ipc://{tmp_path}/sched")
    idle, busy = RecordingAdapter(), RecordingAdapter()
    try:
        for make, adapter in ((lambda: FakeScheduler([], [], [], 0.2), idle), (lambda: BurstScheduler(0.05), busy)):
            with pytest.raises(_Stop):
                scheduler_process.event_loop(make(), puller, adapter)
    finally:
        puller.close()
        ctx.term()
    assert len(idle.ticks) >= 5 and set(idle.ticks) == {0.0}
    assert busy.ticks[0] == 0.0 and len(busy.ticks) > 2 and all(t > 0.0 for t in busy.ticks[1:])


def test_idle_loop_looks_more_often_while_a_thread_is_held_back(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_process, "IDLE_POLL_MS", 1000)
    monkeypatch.setattr(scheduler_process, "ADAPTER_POLL_MS", 10)
    ctx = zmq.Context()
    puller = Puller(ctx, f"ipc://{tmp_path}/sched")
    full, held = RecordingAdapter(), RecordingAdapter(held_back=True)
    try:
        for adapter in (full, held):
            with pytest.raises(_Stop):
                scheduler_process.event_loop(FakeScheduler([], [], [], 0.3), puller, adapter)
    finally:
        puller.close()
        ctx.term()
    assert len(full.ticks) <= 2 and len(held.ticks) >= 10, (len(full.ticks), len(held.ticks))
