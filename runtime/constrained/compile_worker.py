"""The grammar compile worker process: one compile at a time, under a memory limit.

Started as `python -m radixlm.runtime.constrained.compile_worker FD` by `CompilePool`; FD is its end of
a socketpair, used as a `multiprocessing.connection.Connection`:

    pool -> worker   (VocabSpec, whitespace_pattern, memory_limit_mb, preload)   once, first
    worker -> pool   ("ready",)                           once its vocabularies are built
    pool -> worker   (job_id, engine, kind, spec)          one job at a time
    worker -> pool   ("started", job_id)                  engine imported; the deadline starts now
    worker -> pool   ("ok", job_id, CompileResult) | ("error", job_id, message)
    pool -> worker   None                                  exit

The address-space limit (`RLIMIT_AS`, soft) is set to what the process maps after start-up plus
`memory_limit_mb`. A compile that needs more fails: Python code gets MemoryError (reported as an
error), and the Rust engines abort the process, which the pool reports as the limit being hit. The
soft limit is lifted only while an engine library is imported for the first time.
"""

from __future__ import annotations

import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from .engines import EngineSet, VocabSpec
from .regex_rules import GrammarError


def worker_main(conn: Any) -> None:
    """Process entry. Side effects: sets this process's RLIMIT_AS; exits when the pipe closes."""
    from ..utils import kill_self_with_parent

    kill_self_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    vocab, whitespace_pattern, memory_limit_mb, preload = conn.recv()
    vocab = VocabSpec(**vocab) if isinstance(vocab, dict) else vocab
    engines = EngineSet(vocab, whitespace_pattern)
    for engine in preload:
        _warm(engines, engine)
    _limit_memory(memory_limit_mb)
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, engine, kind, spec = msg
        if engine not in preload:      # first job for this engine here: import it without the limit
            _limit_memory(None)
            _warm(engines, engine)
            preload = (*preload, engine)
            _limit_memory(memory_limit_mb)
        conn.send(("started", job_id))
        conn.send(_run_job(engines, job_id, engine, kind, spec, memory_limit_mb))


def _run_job(engines: EngineSet, job_id: int, engine: str, kind: str, spec: str, memory_limit_mb: int) -> tuple:
    try:
        return ("ok", job_id, engines.compile(engine, kind, spec))
    except GrammarError as e:
        return ("error", job_id, str(e))
    except MemoryError:
        return ("error", job_id, memory_error_message(memory_limit_mb))
    except RecursionError:
        return ("error", job_id, "The constraint is nested too deeply to compile")
    except Exception as e:  # noqa: BLE001 - any engine failure fails only this request
        return ("error", job_id, f"Grammar compilation failed: {type(e).__name__}: {e}")


def memory_error_message(memory_limit_mb: int) -> str:
    return (f"Grammar compile exceeded the memory limit of {memory_limit_mb} MB "
            "(--grammar-compile-memory-mb); simplify the constraint")


def _warm(engines: EngineSet, engine: str) -> None:
    if engine == "outlines":
        engines.outlines_vocabulary()
    elif engine == "xgrammar":
        engines.xgrammar_compiler()


def _limit_memory(memory_limit_mb: int | None) -> None:
    """Soft RLIMIT_AS = current address space + memory_limit_mb (None: back to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if memory_limit_mb is None:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        return
    limit = _mapped_bytes() + memory_limit_mb * 1024 * 1024
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
