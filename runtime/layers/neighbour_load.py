"""How much of the machine other processes took while a block of code ran.

    with NeighbourLoad() as load:
        run_timed_kernels()
    load.share       # other processes' CPU time / (wall time x cores); None if /proc/stat is unreadable

Kernel timings are kept only when the neighbours were quiet. This process's own CPU share is no
such signal: a oneDNN call of a few hundred microseconds may keep one of its two threads busy and
leave the other waiting, on an otherwise idle machine. The machine-wide busy time (/proc/stat, in
clock ticks) minus this process's CPU time is; blocks should last a tenth of a second or more, since
/proc/stat counts in ticks of 10 ms.
"""

from __future__ import annotations

import os
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds() -> tuple[float, int] | None:
    """(CPU seconds all cores spent on anything but idle and iowait since boot, number of cores),
    from /proc/stat; None if unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [int(v) for v in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / TICKS_PER_S, max(cores, 1)


Sample = tuple[float, float, "tuple[float, int] | None"]    # (wall s, this process's CPU s, busy_seconds())


def sample() -> Sample:
    return time.perf_counter(), time.process_time(), busy_seconds()


def others_share(start: Sample, end: Sample) -> float | None:
    """Other processes' CPU time between two samples over (wall time x cores); None if unreadable."""
    (t0, own0, busy0), (t1, own1, busy1) = start, end
    if busy0 is None or busy1 is None:
        return None
    others = (busy1[0] - busy0[0]) - (own1 - own0)
    return max(0.0, others) / max((t1 - t0) * busy1[1], 1e-9)


class NeighbourLoad:
    """Context manager measuring other processes' share of all cores over its block."""

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> NeighbourLoad:
        self._start = sample()
        return self

    def __exit__(self, *exc) -> None:
        self.share = others_share(self._start, sample())
