"""Process entry for a scheduler (one per TP rank, per DP replica) and its receive loop.

Rank 0 of a TP group owns the sockets; with tp > 1 it broadcasts each step's received messages
to the other ranks (torch.distributed, gloo group) so every rank runs the identical schedule.
Idle, rank 0 blocks on its socket (up to IDLE_POLL_MS) before each broadcast and the other ranks
block inside the broadcast, so an idle server costs no CPU whatever the TP size. While its only
work is grammars compiling in the worker processes, rank 0 waits on its socket in GRAMMAR_POLL_MS
slices instead of spinning.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

import torch
import zmq

from .. import env
from ..server_args import ServerArgs
from ..utils import configure_logging, kill_self_with_parent
from .io_struct import ChildFailed, SchedulerReady
from .ipc import PortArgs, Puller, Pusher
from .scheduler import IDLE_POLL_MS, Scheduler, set_torch_threads
from .thread_adapter import ThreadAdapter

logger = logging.getLogger(__name__)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, tp_rank: int, dp_rank: int,
                          ready_writer) -> None:
    prefix = f"scheduler dp{dp_rank} tp{tp_rank}" if server_args.dp_size > 1 else f"scheduler tp{tp_rank}"
    configure_logging(server_args.log_level, prefix)
    kill_self_with_parent()
    reproducible_blas(server_args)
    set_torch_threads()
    try:
        scheduler = Scheduler(server_args, tp_rank, dp_rank)
    except Exception as e:  # noqa: BLE001 - report any startup failure to the parent, then exit
        logger.error("scheduler failed to start: %s", traceback.format_exc())
        ready_writer.send(ChildFailed("scheduler", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    ctx = zmq.Context()
    puller = Puller(ctx, port_args.scheduler_input_for(dp_rank)) if tp_rank == 0 else None
    if tp_rank == 0:
        pusher = Pusher(ctx, port_args.detokenizer_input)
        scheduler.send = pusher.send
    ready_writer.send(SchedulerReady(scheduler.runner.info()))
    try:
        adapter = None
        if scheduler.runner.device.type == "cpu" and not scheduler.args.cpu_fixed_threads:
            adapter = ThreadAdapter(torch.get_num_threads())
        event_loop(scheduler, puller, adapter)
    except Exception:  # noqa: BLE001
        logger.error("scheduler crashed: %s", traceback.format_exc())
        sys.exit(1)


def reproducible_blas(server_args: ServerArgs) -> None:
    """With speculative decoding on CPU, asks MKL for its strict reproducible mode (`MKL_CBWR=AUTO,STRICT`)
    unless the environment sets MKL_CBWR: on Intel CPUs with AVX512 its fp32 matmul picks kernels by row
    count, so a one-row decode step and the same row inside a verify pass got different bits and greedy
    outputs parted. Strict mode sums a row the same way whatever the row count. MKL reads the variable
    at its first call, so this runs before the model loads. bf16 weights use oneDNN or radixlm's gemm, not MKL."""
    if server_args.speculative_algorithm is None or server_args.device == "cuda" or env.MKL_CBWR.get() is not None:
        return
    env.MKL_CBWR.set("AUTO,STRICT")
    logger.info("Speculative decoding: MKL_CBWR=AUTO,STRICT (fp32 matmuls give a row the same bits in any batch)")


GRAMMAR_POLL_MS = 5          # how often a scheduler with only compiling grammars checks them
ADAPTER_POLL_MS = 250        # how often an idle scheduler whose adapter dropped a thread looks at the load


def event_loop(scheduler: Scheduler, puller: Puller | None, adapter: ThreadAdapter | None = None) -> None:
    """Receives, steps, repeats; `adapter` (CPU) adapts the thread count to the neighbours' load."""
    while True:
        idle = not scheduler.has_work()
        if idle:                            # while a thread is held back, look at the load more often
            wait_ms = IDLE_POLL_MS if adapter is None or not adapter.held_back() else ADAPTER_POLL_MS
        elif scheduler.waiting or scheduler.running:
            wait_ms = 0
        else:                               # only grammars compiling elsewhere: nothing to run yet
            wait_ms = GRAMMAR_POLL_MS
        msgs = recv_messages(scheduler, puller, wait_ms)
        for msg in msgs:
            scheduler.handle(msg)
        if scheduler.has_work():
            if idle and adapter is not None:
                adapter.idle()              # a burst begins: a quiet moment just now gives a dropped thread back
            start = time.perf_counter()
            scheduler.step()
            if adapter is not None:
                adapter.tick(time.perf_counter() - start)
            if not scheduler.has_work():    # just went idle: final stats now, and a leak check
                scheduler.send(scheduler.stats())
                scheduler.check_idle_invariants()
        elif adapter is not None:           # idle: a quiet look gives a dropped thread back before the next burst
            adapter.idle()


def recv_messages(scheduler: Scheduler, puller: Puller | None, wait_ms: int) -> list:
    """Messages for this step (the same on every TP rank); rank 0 first waits up to `wait_ms` for one."""
    msgs: list = []
    if puller is not None:
        if wait_ms:
            first = puller.recv(timeout_ms=wait_ms)
            if first is not None:
                msgs.append(first)
        msgs.extend(puller.recv_nowait_all())
        msgs.extend(scheduler.timeout_aborts())
        msgs.extend(scheduler.drain_step_times())    # the speculator's costs, the same on every rank
    if scheduler.args.tp_size > 1:
        from ..distributed.parallel_state import broadcast_objects

        msgs = broadcast_objects(msgs)
    return msgs


