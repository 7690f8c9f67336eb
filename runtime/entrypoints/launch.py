"""Starts the child processes of a server or Engine and watches them.

    launch_subprocesses(server_args)
        for each DP replica r, for each local TP rank t:  scheduler process "scheduler dp{r} tp{t}"
        one detokenizer process
        -> waits for every readiness handshake (SchedulerReady / DetokenizerReady); a ChildFailed
           message or a child that exits first raises RuntimeError with the child's error text
        -> Subprocesses: scheduler_info, port_args, processes, start_watchdog(), shutdown()

Each child is its own `python -m radixlm.runtime.entrypoints.child` process (subprocess.Popen with
this interpreter, environment from `child_env`), so it never imports the caller's `__main__`:
scripts without an `if __name__ == "__main__"` guard, pytest and Jupyter all work. The handshake
travels over a socketpair per child; its EOF also tells the watchdog that the child died.
Children die with the parent: each asks Linux for SIGKILL on parent death (PR_SET_PDEATHSIG, see
runtime/utils.py), and since that signal follows the *thread* that started the child, children
are always started from a thread that lives as long as the process. An atexit hook shuts down
whatever is still running at a normal interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ..env import child_environ
from ..managers.io_struct import ChildFailed, DetokenizerReady, SchedulerReady
from ..managers.ipc import PortArgs
from ..server_args import ServerArgs
from .cpu_env import cpu_child_env
from .server_info import format_fast_paths

logger = logging.getLogger(__name__)

CHILD_MODULE = "radixlm.runtime.entrypoints.child"
SCHEDULER_TARGET = ("radixlm.runtime.managers.scheduler_process", "run_scheduler_process")
DETOKENIZER_TARGET = ("radixlm.runtime.managers.detokenizer_manager", "run_detokenizer_process")


def child_env(server_args: ServerArgs) -> tuple[dict[str, str], list[str]]:
    """The environment of every child process, and the lines it adds to the startup block: this
    process's environment, plus
    - every RADIXLM_* switch set from its flag (runtime/env.py), so the kernels in the children
      see what the flags said;
    - PYTHONPATH = this interpreter's sys.path, so the child imports the same radixlm;
    - the CPU settings of `cpu_env.cpu_child_env` (torch threads per scheduler, OpenMP wait
      policy, tcmalloc)."""
    env = child_environ(server_args)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return cpu_child_env(server_args, env)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    conn: Connection            # the parent's end of the handshake socketpair
    ready_msg: Any = None


@dataclass(eq=False)     # hashable by identity (kept in a WeakSet)
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
    def processes(self) -> dict[str, subprocess.Popen]:
        return {c.name: c.process for c in self.children}

    def pid_of(self, name: str) -> int | None:
        return self.processes[name].pid

    def start_watchdog(self, on_child_death: Callable[[str, int | None], None]) -> threading.Thread:
        """Calls `on_child_death(name, exitcode)` (once, from the watchdog thread) when a child
        exits before `shutdown()`. It wakes on any child's exit at once (its handshake socket hits
        EOF), and re-checks liveness every `watchdog_interval` seconds."""
        thread = threading.Thread(target=self._watch, args=(on_child_death,), name="radixlm-watchdog",
                                  daemon=True)
        thread.start()
        return thread

    def _watch(self, on_child_death: Callable[[str, int | None], None]) -> None:
        interval = max(self.server_args.watchdog_interval, 0.05)
        watched = {c.conn: c for c in self.children}
        hung_up: list[Child] = []
        while not self._stop.is_set():
            for conn in wait(list(watched), timeout=interval):   # readable after the handshake = EOF
                hung_up.append(watched.pop(conn))
            if self._stop.is_set():
                return
            dead = self._first_dead(hung_up)
            if dead is not None:
                self._stop.set()
                logger.error("%s died (exit code %s)", dead.name, dead.process.returncode)
                try:
                    on_child_death(dead.name, dead.process.returncode)
                except Exception:  # noqa: BLE001
                    logger.exception("on_child_death callback failed")
                return

    def _first_dead(self, hung_up: list[Child]) -> Child | None:
        """A child that exited; one whose socket hit EOF gets a moment for its exit status."""
        for c in hung_up:
            try:
                c.process.wait(timeout=1.0)
                return c
            except subprocess.TimeoutExpired:
                pass
        return next((c for c in self.children if c.process.poll() is not None), None)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Terminates every child (SIGTERM, then SIGKILL after `timeout`), waits for them and
        removes the IPC directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        for c in self.children:
            if c.process.poll() is None:
                c.process.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            try:
                c.process.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit after SIGTERM; killing it", c.name)
                c.process.kill()
                c.process.wait(1.0)
        for c in self.children:
            c.conn.close()
        self.port_args.cleanup()


_running: weakref.WeakSet[Subprocesses] = weakref.WeakSet()


@atexit.register
def _shutdown_all_at_exit() -> None:
    for subs in list(_running):
        subs.shutdown()


def launch_subprocesses(server_args: ServerArgs, on_child_death: Callable[[str, int | None], None] | None = None,
                        port_args: PortArgs | None = None, startup_timeout: float | None = None) -> Subprocesses:
    """Starts the schedulers and the detokenizer and waits until all are ready, then starts the
    watchdog when `on_child_death` is given. Raises RuntimeError (after stopping whatever started)
    if a child fails or dies during startup. A bad model path, architecture, context length or
    TP size is refused first, in this process, with ModelLoadError (a ValueError)."""
    preflight(server_args)
    port_args = port_args or PortArgs.new()
    env, cpu_notes = child_env(server_args)
    subs = Subprocesses(server_args, port_args, [])
    _running.add(subs)
    try:
        for dp_rank in range(server_args.dp_size):
            replica_args = _replica_args(server_args, dp_rank)
            for tp_rank in _local_tp_ranks(server_args):
                name = f"scheduler dp{dp_rank} tp{tp_rank}"
                subs.children.append(_start_child(name, SCHEDULER_TARGET, env,
                                                  (replica_args, port_args, tp_rank, dp_rank)))
        if server_args.node_rank == 0:   # nodes 1.. of a multi-node TP group run schedulers only
            subs.children.append(_start_child("detokenizer", DETOKENIZER_TARGET, env, (server_args, port_args)))
        _wait_ready(subs.children, startup_timeout)
    except BaseException:
        subs.shutdown()
        raise
    first = next(c for c in subs.children if isinstance(c.ready_msg, SchedulerReady))
    subs.scheduler_info = dict(first.ready_msg.info)
    logger.info("\n".join(format_fast_paths(subs.scheduler_info.get("fast_paths") or {}, cpu_notes)))
    if on_child_death is not None:
        subs.start_watchdog(on_child_death)
    return subs


def preflight(args: ServerArgs) -> None:
    """Cheap checks of the model before any child starts (reads config.json only)."""
    from ..models.model_config import ModelConfig

    config = ModelConfig.from_path(args.model_path, dtype=args.dtype, context_length=args.context_length,
                                   overrides=args.model_overrides)
    config.check_tp_size(args.tp_size)


def _replica_args(args: ServerArgs, dp_rank: int) -> ServerArgs:
    """Gives each TP group its own torch.distributed rendezvous address."""
    if args.tp_size == 1:
        return args
    if args.dist_init_addr is None:
        from ..utils import free_port

        return args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
    host, port = args.dist_init_addr.rsplit(":", 1)
    return args.replace(dist_init_addr=f"{host}:{int(port) + dp_rank}")


def _local_tp_ranks(args: ServerArgs) -> range:
    per_node = max(args.tp_size // max(args.nnodes, 1), 1)
    start = args.node_rank * per_node
    return range(start, min(start + per_node, args.tp_size))


def _start_child(name: str, target: tuple[str, str], env: dict[str, str], args: tuple) -> Child:
    """Starts `python -m CHILD_MODULE` and sends it its job; the child's reply is the handshake."""
    parent_sock, child_sock = socket.socketpair()
    fd = child_sock.fileno()
    python = [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]  # -P: no cwd on sys.path
    cmd = [*python, "-m", CHILD_MODULE, str(fd), str(os.getpid())]
    try:
        proc = _start_from_long_lived_thread(lambda: subprocess.Popen(
            cmd, env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL))
    finally:
        child_sock.close()      # the child holds the only other end: its death makes ours hit EOF
    conn = Connection(parent_sock.detach())
    try:
        conn.send((*target, args))
    except OSError:             # it died at once; _wait_ready reports the exit code
        pass
    return Child(name, proc, conn)


def _wait_ready(children: list[Child], timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {c.conn: c for c in children}
    while pending:
        for conn in wait(list(pending), timeout=0.5):
            child = pending.pop(conn)
            try:
                child.ready_msg = conn.recv()
            except (EOFError, OSError):
                try:
                    child.process.wait(2.0)
                except subprocess.TimeoutExpired:
                    pass
                raise RuntimeError(f"{child.name} exited during startup (exit code "
                                   f"{child.process.returncode}); see its log above") from None
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


def _start_from_long_lived_thread(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    global _launcher
    if threading.current_thread() is threading.main_thread():
        return start()
    with _launcher_lock:
        if _launcher is None:
            _launcher = _Launcher()
    return _launcher.call(start)
