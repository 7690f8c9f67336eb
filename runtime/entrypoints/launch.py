"""Starts the child processes of a server or Engine and watches them.

    launch_subprocesses(server_args)
        for each DP replica r, for each local TP rank t:  scheduler process "scheduler dp{r} tp{t}"
        one detokenizer process
        -> waits for every readiness handshake (SchedulerReady / DetokenizerReady); a ChildFailed
           message or a child that exits first raises RuntimeError with the child's error text
        -> Subprocesses: scheduler_info, port_args, processes, start_watchdog(), shutdown()

Children use the multiprocessing *spawn* context (no forked torch/CUDA/ZMQ state). They die with
the parent: each child asks Linux for SIGKILL on parent death (PR_SET_PDEATHSIG, see
runtime/utils.py), and since that signal follows the *thread* that started the child, children
are always started from a thread that lives as long as the process. They are also daemonic, so
multiprocessing terminates them at a normal interpreter exit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from radixlm.runtime.managers.io_struct import ChildFailed, DetokenizerReady, SchedulerReady
from radixlm.runtime.managers.ipc import PortArgs
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

SCHEDULER_TARGET = ("radixlm.runtime.managers.scheduler_process", "run_scheduler_process")
DETOKENIZER_TARGET = ("radixlm.runtime.managers.detokenizer_manager", "run_detokenizer_process")


def _child_entry(module: str, func: str, args: tuple) -> None:
    """Runs in the child: Ctrl-C goes to the parent, which shuts the children down in order."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:   # tqdm's default lock is a multiprocessing semaphore, leaked when a child is terminated
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    getattr(importlib.import_module(module), func)(*args)


@dataclass
class Child:
    name: str
    process: BaseProcess
    ready_reader: Connection
    ready_msg: Any = None


@dataclass
class Subprocesses:
    """Handle on the running children. `shutdown()` is idempotent and safe from any thread."""

    server_args: ServerArgs
    port_args: PortArgs
    children: list[Child]
    scheduler_info: dict[str, Any] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    @property
    def processes(self) -> dict[str, BaseProcess]:
        return {c.name: c.process for c in self.children}

    def pid_of(self, name: str) -> int | None:
        return self.processes[name].pid

    def all_alive(self) -> bool:
        return all(c.process.is_alive() for c in self.children)

    def start_watchdog(self, on_child_death: Callable[[str, int | None], None]) -> threading.Thread:
        """Calls `on_child_death(name, exitcode)` (once, from the watchdog thread) when a child
        exits before `shutdown()`. It wakes on any child's exit at once, and re-checks liveness
        every `watchdog_interval` seconds."""
        thread = threading.Thread(target=self._watch, args=(on_child_death,), name="radixlm-watchdog",
                                  daemon=True)
        thread.start()
        return thread

    def _watch(self, on_child_death: Callable[[str, int | None], None]) -> None:
        interval = max(self.server_args.watchdog_interval, 0.05)
        sentinels = [c.process.sentinel for c in self.children]
        while not self._stop.is_set():
            wait(sentinels, timeout=interval)
            if self._stop.is_set():
                return
            dead = next((c for c in self.children if not c.process.is_alive()), None)
            if dead is not None:
                self._stop.set()
                logger.error("%s died (exit code %s)", dead.name, dead.process.exitcode)
                try:
                    on_child_death(dead.name, dead.process.exitcode)
                except Exception:  # noqa: BLE001
                    logger.exception("on_child_death callback failed")
                return

    def shutdown(self, timeout: float = 5.0) -> None:
        """Terminates every child (SIGTERM, then SIGKILL after `timeout`), joins them and removes
        the IPC directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        procs = [c.process for c in self.children]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0))
        for p in procs:
            if p.is_alive():
                logger.warning("%s did not exit after SIGTERM; killing it", p.name)
                p.kill()
                p.join(1.0)
        for c in self.children:
            c.ready_reader.close()
        self.port_args.cleanup()


def launch_subprocesses(server_args: ServerArgs, on_child_death: Callable[[str, int | None], None] | None = None,
                        port_args: PortArgs | None = None, startup_timeout: float | None = None) -> Subprocesses:
    """Starts the schedulers and the detokenizer and waits until all are ready, then starts the
    watchdog when `on_child_death` is given. Raises RuntimeError (after stopping whatever started)
    if a child fails or dies during startup. A bad model path, architecture, context length or
    TP size is refused first, in this process, with ModelLoadError (a ValueError)."""
    preflight(server_args)
    # OpenMP threads that spin while waiting starve each other (and the tokenizer/detokenizer
    # processes) on a busy CPU: measured 80x slower decode on 2 loaded cores. Sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    port_args = port_args or PortArgs.new()
    ctx = mp.get_context("spawn")
    subs = Subprocesses(server_args, port_args, [])
    try:
        for dp_rank in range(server_args.dp_size):
            replica_args = _replica_args(server_args, dp_rank)
            for tp_rank in _local_tp_ranks(server_args):
                name = f"scheduler dp{dp_rank} tp{tp_rank}"
                subs.children.append(_start_child(ctx, name, SCHEDULER_TARGET,
                                                  (replica_args, port_args, tp_rank, dp_rank)))
        subs.children.append(_start_child(ctx, "detokenizer", DETOKENIZER_TARGET, (server_args, port_args)))
        _wait_ready(subs.children, startup_timeout)
    except BaseException:
        subs.shutdown()
        raise
    first = next(c for c in subs.children if isinstance(c.ready_msg, SchedulerReady))
    subs.scheduler_info = dict(first.ready_msg.info)
    if on_child_death is not None:
        subs.start_watchdog(on_child_death)
    return subs


def preflight(args: ServerArgs) -> None:
    """Cheap checks of the model before any child starts (reads config.json only)."""
    from radixlm.runtime.models.model_config import ModelConfig

    config = ModelConfig.from_path(args.model_path, dtype=args.dtype, context_length=args.context_length)
    config.check_tp_size(args.tp_size)


def _replica_args(args: ServerArgs, dp_rank: int) -> ServerArgs:
    """Gives each TP group its own torch.distributed rendezvous address."""
    if args.tp_size == 1:
        return args
    if args.dist_init_addr is None:
        from radixlm.runtime.utils import free_port

        return args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
    host, port = args.dist_init_addr.rsplit(":", 1)
    return args.replace(dist_init_addr=f"{host}:{int(port) + dp_rank}")


def _local_tp_ranks(args: ServerArgs) -> range:
    per_node = max(args.tp_size // max(args.nnodes, 1), 1)
    start = args.node_rank * per_node
    return range(start, min(start + per_node, args.tp_size))


def _start_child(ctx: Any, name: str, target: tuple[str, str], args: tuple) -> Child:
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(*target, (*args, writer)), name=name, daemon=True)
    _start_from_long_lived_thread(proc)
    writer.close()          # the child holds the only writer: its death makes `reader` hit EOF
    return Child(name, proc, reader)


def _wait_ready(children: list[Child], timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {c.ready_reader: c for c in children}
    while pending:
        for reader in wait(list(pending), timeout=0.5):
            child = pending.pop(reader)
            try:
                child.ready_msg = reader.recv()
            except EOFError:
                child.process.join(1.0)
                raise RuntimeError(f"{child.name} exited during startup (exit code "
                                   f"{child.process.exitcode}); see its log above") from None
            if isinstance(child.ready_msg, ChildFailed):
                raise RuntimeError(f"{child.name} failed to start: {child.ready_msg.error}")
            if not isinstance(child.ready_msg, (SchedulerReady, DetokenizerReady)):
                raise RuntimeError(f"{child.name} sent an unexpected handshake {child.ready_msg!r}")
            logger.debug("%s is ready", child.name)
        if deadline is not None and time.monotonic() > deadline and pending:
            names = ", ".join(c.name for c in pending.values())
            raise RuntimeError(f"timed out after {timeout} s waiting for {names} to start")


# ------------------------------------------------------ the launcher thread
class _Launcher:
    """One daemon thread that starts child processes for callers that are not the main thread
    (PR_SET_PDEATHSIG would kill the child when a short-lived starting thread exits)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        threading.Thread(target=self._run, name="radixlm-launcher", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(e)

    def call(self, fn: Callable[[], Any]) -> Any:
        fut: Future = Future()
        self.jobs.put((fn, fut))
        return fut.result()


_launcher: _Launcher | None = None
_launcher_lock = threading.Lock()


def _start_from_long_lived_thread(proc: BaseProcess) -> None:
    global _launcher
    if threading.current_thread() is threading.main_thread():
        proc.start()
        return
    with _launcher_lock:
        if _launcher is None:
            _launcher = _Launcher()
    _launcher.call(proc.start)
