"""The server process's life: start the children, serve HTTP on uvloop, announce readiness, exit.

    run_server(server_args)      # what `radixlm-server` / radixlm.launch_server run; never returns

Order: check flags and the port -> launch_subprocesses (model load, readiness handshake) -> print
the capacity report -> TokenizerManager + app inside the event loop -> uvicorn -> a 1-token
generation -> log READY_LINE.

Exits: SIGINT/SIGTERM stop uvicorn gracefully (3 s at most), then every child is shut down; exit 0.
A child that dies (the watchdog calls `on_child_death` from its thread) fails every in-flight
request with an error, marks /health 503, stops uvicorn, and the process exits 1; a timer forces
the exit if the graceful path has not finished within CHILD_DEATH_EXIT_S.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from ..server_args import ServerArgs
from ..utils import READY_LINE, WORKER_READY_LINE, configure_logging
from .chat_template import CHAT_TEMPLATES
from .http_limits import HttpLimits, limited_h11_protocol
from .http_server import ServerState, create_app
from .server_info import capacity_report, format_capacity, health_generate

logger = logging.getLogger("radixlm.server")
CHILD_DEATH_EXIT_S = 3.5
SIGNAL_RACE_S = 0.3
GRACEFUL_SHUTDOWN_S = 3
WARMUP_TIMEOUT_S = 600.0


def run_server(server_args: ServerArgs) -> None:
    configure_logging(server_args.log_level, "server")
    _disable_created_metrics()
    args = server_args.resolved()
    args.validate()
    check_chat_template_flag(args.chat_template)
    if args.node_rank == 0:              # other nodes of a multi-node TP group serve no HTTP
        check_port_free(args.host, args.port)
    life = ServerLifecycle(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, life.on_signal)
    try:
        life.start_children()
        if args.node_rank == 0:
            _run_loop(life.serve())
        else:
            life.wait_as_worker_node()
    except KeyboardInterrupt:
        logger.info("Interrupted before the server was up")
    finally:
        life.stop_children()
    logging.shutdown()
    gc.freeze()     # the exit-time collection of torch/transformers' object graph took seconds
    sys.exit(life.exit_code)


def _run_loop(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:   # uvloop is a dependency off Windows; plain asyncio elsewhere
        asyncio.run(coro)
        return
    uvloop.run(coro)


class ServerLifecycle:
    """Holds what signal handlers and the child watchdog need to reach."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.subprocesses: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: Any = None            # uvicorn.Server, once serving
        self.tm: Any = None
        self.state: ServerState | None = None
        self.child_failure: str | None = None
        self.shutdown_signal: int | None = None
        self.exit_code = 0

    # ------------------------------------------------------------------ children
    def start_children(self) -> None:
        from .launch import launch_subprocesses

        self.subprocesses = launch_subprocesses(self.args, on_child_death=self.on_child_death)
        info = self.subprocesses.scheduler_info
        for line in format_capacity(capacity_report(info, int(info.get("context_len") or 0))):
            logger.info(line)

    def stop_children(self) -> None:
        if self.subprocesses is not None:
            subprocesses, self.subprocesses = self.subprocesses, None
            subprocesses.shutdown()

    def wait_as_worker_node(self) -> None:
        """Nodes 1.. of a multi-node TP group run only their schedulers: node 0 owns the HTTP
        server, the tokenizer and the detokenizer and broadcasts every step to all ranks. Returns
        on a signal or when a scheduler dies (as it does when node 0 goes away)."""
        ranks = sorted(int(n.rsplit("tp", 1)[1]) for n in self.subprocesses.processes if "scheduler" in n)
        logger.info("%s (node %d of %d: TP ranks %s; node 0 at %s serves the API)", WORKER_READY_LINE,
                    self.args.node_rank, self.args.nnodes, ranks, self.args.dist_init_addr)
        while self.child_failure is None:
            time.sleep(0.2)

    # ------------------------------------------------------------------ serving
    async def serve(self) -> None:
        import uvicorn

        from ..managers.tokenizer_manager import TokenizerManager
        from ..metrics import MetricsCollector

        self.loop = asyncio.get_running_loop()
        info = self.subprocesses.scheduler_info
        metrics = MetricsCollector(self.args.model_name, self.args.page_size)
        metrics.set_max_total_tokens(int(info.get("max_total_tokens") or 0))
        self.tm = TokenizerManager(self.args, self.subprocesses.port_args, info, metrics=metrics)
        app = create_app(self.tm, self.args, metrics)
        self.state = app.state.server
        config = uvicorn.Config(app, host=self.args.host, port=self.args.port,
                                log_level=self.args.log_level_http or self.args.log_level,
                                http=limited_h11_protocol(HttpLimits.from_args(self.args)),
                                access_log=self.args.enable_access_log, lifespan="off", timeout_keep_alive=5,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, backlog=4096)
        self.server = _make_uvicorn_server(config, self)
        if self.child_failure:   # died between the handshake and now
            self._fail_in_loop(self.child_failure)
        ready = asyncio.create_task(self._announce_ready())
        try:
            await self.server.serve()
        finally:
            ready.cancel()
        if self.server.started is False and not self.child_failure:
            self.exit_code = 1

    async def _announce_ready(self) -> None:
        while not self.server.started:
            if self.server.should_exit:
                return
            await asyncio.sleep(0.05)
        problem = await health_generate(self.tm, timeout=WARMUP_TIMEOUT_S)
        if problem:
            logger.error("The warm-up generation failed (%s); shutting down", problem)
            self.exit_code = 1
            self.server.should_exit = True
            return
        gc.freeze()     # startup objects (model config, tokenizer, modules) leave the GC's scans:
        logger.info(READY_LINE)     # full collections under load stay short

    # ------------------------------------------------------------------ events
    def on_signal(self, signum: int, _frame: Any) -> None:
        logger.info("Received %s; shutting down", signal.Signals(signum).name)
        self.shutdown_signal = signum
        if self.server is None:
            raise KeyboardInterrupt
        self.server.should_exit = True

    def on_child_death(self, name: str, exitcode: int | None) -> None:
        """Called from the watchdog thread; may be called once per dead child.

        A child killed by the same SIGTERM/SIGINT as the server (a signal sent to the whole process
        group, as `timeout` or a terminal does) is part of a normal shutdown, not a failure.
        """
        if self.child_failure is not None:
            return
        if exitcode in (-signal.SIGTERM, -signal.SIGINT):
            time.sleep(SIGNAL_RACE_S)    # let the main thread run our own handler for that signal
            if self.shutdown_signal is not None:
                logger.info("child process '%s' stopped by the shutdown signal", name)
                self._call_in_loop(self._stop_serving)
                return
        message = f"child process '{name}' died (exit code {exitcode})"
        logger.error("%s; failing in-flight requests and shutting down", message)
        self.child_failure = message
        self.exit_code = 1
        threading.Thread(target=self._force_exit_later, name="radixlm-exit-timer", daemon=True).start()
        self._call_in_loop(self._fail_in_loop, message)

    def _call_in_loop(self, fn: Any, *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:   # the loop closed meanwhile
                pass

    def _fail_in_loop(self, message: str) -> None:
        if self.state is not None:
            self.state.failure = message
        if self.tm is not None:
            self.tm.fail_all(f"Server failure: {message}")
        self._stop_serving()

    def _stop_serving(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def _force_exit_later(self) -> None:
        time.sleep(CHILD_DEATH_EXIT_S)
        logger.error("Graceful shutdown took too long; exiting")
        stopper = threading.Thread(target=self.stop_children, daemon=True)
        stopper.start()
        stopper.join(1.0)
        os._exit(1)


def _make_uvicorn_server(config: Any, life: ServerLifecycle) -> Any:
    """uvicorn's Server, noting the shutdown signal (uvicorn owns SIGINT/SIGTERM while serving)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            life.shutdown_signal = sig
            super().handle_exit(sig, frame)

    return Server(config)


# ---------------------------------------------------------------------- checks and logging
def _disable_created_metrics() -> None:
    try:
        from prometheus_client import disable_created_metrics

        disable_created_metrics()   # no *_created samples in /metrics
    except ImportError:
        pass


def check_chat_template_flag(spec: str | None) -> None:
    if spec and spec not in CHAT_TEMPLATES and not os.path.isfile(spec):
        raise SystemExit(f"error: --chat-template {spec!r} is neither a file nor one of: "
                         f"{', '.join(CHAT_TEMPLATES)}")


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror or e}") from None
