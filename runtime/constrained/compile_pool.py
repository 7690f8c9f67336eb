"""CompilePool: grammar compiles in worker processes that can be killed, with a deadline each.

    submit() ──job──▶ queue ──▶ idle ready worker ──▶ compile ──▶ Future resolved (pool thread)
                                   │ deadline passed: SIGKILL, the job fails, a new worker starts
                                   │ worker died (memory limit): the job fails, a new worker starts

- `submit` never blocks: it queues the job and wakes the pool thread, which owns every worker.
- A job starts as soon as a worker is free. The pool keeps one spare worker ready while it has fewer
  than `max_workers`, so a slow compile never delays another request's compile (up to
  `max_workers - 1` slow ones at once).
- Each worker compiles one job at a time under `RLIMIT_AS` (see compile_worker.py); its
  address space, and so the scheduler's, is returned to the OS when it is killed.
- Workers are fresh interpreters (`python -m ...compile_worker`, no fork of a process that holds
  CUDA or torch threads, and no re-import of the caller's `__main__` as multiprocessing's spawn
  does); they talk over a socketpair and die with the process that started them.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ..env import environ_copy
from .compile_worker import memory_error_message
from .engines import CompileResult, VocabSpec
from .regex_rules import GrammarError

logger = logging.getLogger(__name__)
TICK_S = 0.05
LOAD_DEADLINE_S = 180.0   # a worker's first job of an engine may import it (xgrammar imports torch)


@dataclass(eq=False)
class _Job:
    job_id: int
    engine: str
    kind: str
    spec: str
    future: Future[CompileResult] = field(default_factory=Future)
    sent_at: float = 0.0
    started_at: float | None = None      # when the worker began compiling (engine loaded)


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    job: _Job | None = None


class CompilePool:
    def __init__(self, vocab: VocabSpec, whitespace_pattern: str | None, timeout_s: float,
                 memory_limit_mb: int, min_workers: int = 2, max_workers: int = 4,
                 preload: tuple[str, ...] = ("outlines",)) -> None:
        self.vocab = vocab
        self.whitespace_pattern = whitespace_pattern
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.min_workers = max(1, min_workers)
        self.max_workers = max(self.min_workers, max_workers)
        self.preload = preload
        self.workers_started = 0
        self.workers_killed = 0
        self._workers: list[_Worker] = []
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        wake_r, wake_w = socket.socketpair()
        self._wake_r, self._wake_w = Connection(wake_r.detach()), Connection(wake_w.detach())
        self._next_id = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="grammar-compile-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, engine: str, kind: str, spec: str) -> Future[CompileResult]:
        """Queue one compile; the future resolves to a CompileResult or raises GrammarError."""
        with self._lock:
            self._next_id += 1
            job = _Job(self._next_id, engine, kind, spec)
            if self._closed:
                job.future.set_exception(GrammarError("The grammar compiler is shut down"))
                return job.future
            self._queue.append(job)
        self._wake_w.send(None)
        return job.future

    def num_workers(self) -> int:
        with self._lock:
            return len(self._workers)

    def shutdown(self) -> None:
        """Kill every worker and fail queued jobs. Safe to call twice."""
        with self._lock:
            self._closed = True
        try:
            self._wake_w.send(None)
        except OSError:
            pass
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ pool thread
    def _run(self) -> None:
        try:
            while not self._closed:
                self._maintain()
                conns = [w.conn for w in self._workers] + [self._wake_r]
                for conn in wait(conns, timeout=TICK_S):
                    if conn is self._wake_r:
                        self._wake_r.recv()
                    else:
                        self._on_message(next(w for w in self._workers if w.conn is conn))
                self._enforce_deadlines()
        except Exception:  # noqa: BLE001 - fail everything rather than hang requests
            logger.exception("grammar compile pool crashed")
        finally:
            self._stop_all()

    def _maintain(self) -> None:
        """Dispatch queued jobs to idle workers, then keep one spare (or min_workers) ready."""
        for w in self._workers:
            if w.ready and w.job is None and self._queue:
                with self._lock:
                    job = self._queue.popleft()
                job.sent_at = time.monotonic()
                w.job = job
                w.conn.send((job.job_id, job.engine, job.kind, job.spec))
        free = sum(w.job is None for w in self._workers)
        want = max(self.min_workers - len(self._workers), len(self._queue) + 1 - free)
        for _ in range(min(want, self.max_workers - len(self._workers))):
            self._start_worker()

    def _start_worker(self) -> None:
        parent, child = socket.socketpair()
        fd = child.fileno()
        process = subprocess.Popen(
            [sys.executable, "-m", "radixlm.runtime.constrained.compile_worker", str(fd)],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, env={**environ_copy(), "PYTHONUNBUFFERED": "1"})
        child.close()
        conn = Connection(parent.detach())
        conn.send((self.vocab, self.whitespace_pattern, self.memory_limit_mb, self.preload))
        self._workers.append(_Worker(process, conn))
        self.workers_started += 1

    def _on_message(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._retire(w, self._death_message(w))
            return
        if msg[0] == "ready":
            w.ready = True
            return
        if msg[0] == "started":
            if w.job is not None and w.job.job_id == msg[1]:
                w.job.started_at = time.monotonic()
            return
        job, w.job = w.job, None
        if job is None or job.job_id != msg[1]:
            return
        if msg[0] == "ok":
            job.future.set_result(msg[2])
        else:
            job.future.set_exception(GrammarError(msg[2]))

    def _death_message(self, w: _Worker) -> str:
        try:
            code = w.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        if code in (-6, -9, -11) or code is None:   # abort on failed allocation, or the OOM killer
            return memory_error_message(self.memory_limit_mb)
        return f"The grammar compile worker exited unexpectedly (exit code {code})"

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            job = w.job
            if job is None:
                continue
            late = (now - job.started_at > self.timeout_s if job.started_at is not None
                    else now - job.sent_at > max(self.timeout_s, LOAD_DEADLINE_S))
            if late:
                self.workers_killed += 1
                self._retire(w, f"Grammar compile timed out after {self.timeout_s:g} s "
                                "(--grammar-compile-timeout); simplify the constraint")

    def _retire(self, w: _Worker, message: str) -> None:
        """Kill one worker; its job (if any) fails with `message`. A replacement starts in _maintain."""
        if w.process.poll() is None:
            w.process.kill()
        try:
            w.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("grammar compile worker %d did not exit after SIGKILL", w.process.pid)
        w.conn.close()
        self._workers.remove(w)
        if w.job is not None and not w.job.future.done():
            w.job.future.set_exception(GrammarError(message))

    def _stop_all(self) -> None:
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for w in list(self._workers):
            self._retire(w, "The grammar compiler is shut down")
        for job in queued:
            job.future.set_exception(GrammarError("The grammar compiler is shut down"))
