"""The process environment of the children on CPU: torch threads, OpenMP wait policy, tcmalloc.

    env, notes = cpu_child_env(server_args, radixlm_env.child_environ(server_args))   # notes: startup log

What each setting did for radixlm (SmolLM2-135M bf16, 2 cores, benchmarks/README.md has the runs):

- **Threads**: each scheduler gets cores // (tp_size * dp_size) torch threads (at least one), so
  the scheduler processes of one server never ask for more threads than there are cores.
  `--num-threads` (or `RADIXLM_NUM_THREADS`) overrides it.
- **OpenMP wait policy**: left to the runtime's default (threads spin a short while after a
  parallel region, then sleep) when the threads fit the cores. OMP_WAIT_POLICY=PASSIVE (sleep at
  once) made every one of the ~150 parallel regions of a decode step pay a wake-up: at batch 1
  TPOT went from 25 to 35-38 ms, at concurrency 16 throughput fell from 221 to 155 tok/s. When
  the threads oversubscribe the cores (an explicit `--num-threads`, or more schedulers than
  cores) PASSIVE is set, since spinning threads then starve each other (measured 80x slower).
  An OMP_WAIT_POLICY in the environment always wins. Spinning has one cost: beside a busy process
  (a compile, another server) a decode step went from 29 to 300 ms; each scheduler then drops a
  thread while that lasts (runtime/managers/thread_adapter.py; `--cpu-fixed-threads` keeps the count).
- **tcmalloc** (Debian's `libtcmalloc-minimal4`) goes into LD_PRELOAD when installed: with the
  default wait policy it took batch-1 TPOT from 28-31 to 25 ms. `--disable-cpu-preload` (or
  `RADIXLM_DISABLE_CPU_PRELOAD=1`) leaves LD_PRELOAD alone.
- Not used, because they measured slower: Intel's OpenMP (libiomp5, preloaded as vLLM does:
  203 against 221 tok/s at concurrency 16) and binding threads to cores (OMP_PROC_BIND=true: 126
  against 221 tok/s; the HTTP and detokenizer processes then share a core with a bound thread).
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import env as radixlm_env
from ..server_args import ServerArgs

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SYSTEM_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu")


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc shared library, or None."""
    for folder in SYSTEM_LIB_DIRS:
        for name in TCMALLOC_NAMES:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_child_env(server_args: ServerArgs, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` plus the CPU settings above for the child processes; returns (env, startup log lines).
    On CUDA only the thread count is set (the schedulers' CPU work is light there)."""
    env = dict(env)
    notes: list[str] = []
    cores = available_cores()
    schedulers = server_args.tp_size // server_args.nnodes * server_args.dp_size    # on this node
    threads = radixlm_env.NUM_THREADS.get(env) or max(cores // schedulers, 1)
    env[radixlm_env.NUM_THREADS.name] = str(threads)
    if server_args.device != "cpu":
        return env, notes
    if "OMP_WAIT_POLICY" not in env and threads * schedulers > cores:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    adapt = ("fixed" if server_args.cpu_fixed_threads or radixlm_env.CPU_FIXED_THREADS.get(env)
             else "one fewer while other processes keep a core busy")
    notes.append(f"{schedulers} scheduler(s) x {threads} torch thread(s) on {cores} core(s) ({adapt}), "
                 f"OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', 'default')}")
    if server_args.disable_cpu_preload or radixlm_env.DISABLE_CPU_PRELOAD.get(env):
        notes.append("tcmalloc: not preloaded (disabled)")
        return env, notes
    path = find_tcmalloc()
    if path is None:
        notes.append("tcmalloc: not installed (apt-get install libtcmalloc-minimal4), glibc malloc in use")
        return env, notes
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if path not in preload:
        env["LD_PRELOAD"] = ":".join([*preload, path])
    notes.append(f"tcmalloc: preloading {path}")
    return env, notes
