"""Small process helpers shared by the server and its child processes."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

READY_LINE = "The server is fired up and ready to roll!"   # logged once the warm-up generation worked
WORKER_READY_LINE = "The worker node is ready"   # a node > 0 of a multi-node TP group: its schedulers are up


def configure_logging(level: str, prefix: str) -> None:
    """Replaces the root logger's handlers: `[12:00:00 prefix] INFO message` lines on stderr."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), force=True,
                        format=f"[%(asctime)s {prefix}] %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)


def kill_self_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no child is ever orphaned.
    Exits at once when the parent (`parent_pid`, or any parent when None) is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    ppid = os.getppid()
    if ppid == 1 or (parent_pid is not None and ppid != parent_pid):   # died before prctl took effect
        os._exit(1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b, for a >= 0 and b > 0 (e.g. pages needed for `a` tokens)."""
    return (a + b - 1) // b


def align_down(x: int, page_size: int) -> int:
    """`x` rounded down to a multiple of `page_size` (the cacheable part of a sequence)."""
    return x // page_size * page_size


def align_up(x: int, page_size: int) -> int:
    """`x` rounded up to a multiple of `page_size` (the end of the page holding token x - 1)."""
    return ceil_div(x, page_size) * page_size


def to_device(t, device):
    """`t` (a CPU tensor) on `device`. On CUDA the copy is staged through pinned (page-locked) host
    memory and enqueued with `non_blocking=True`, so the host does not wait for the device; torch's
    caching host allocator keeps the staging block alive until the copy has run. Elsewhere a plain
    `.to(device)`. Returns `t` itself when it already lives there."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not t.is_cpu:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
