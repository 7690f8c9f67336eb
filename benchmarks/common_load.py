"""Machine and load recording for the benchmarks (Linux /proc).

The machine is shared, so a figure means little without the load it ran under. `LoadMonitor`
samples /proc/stat while a run goes on and splits the busy CPU time into the part used by this
benchmark's own process tree (the engine or server it started included) and the rest ("other").
`machine_info()` records cores, CPU model and features, RAM and library versions.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.testing.server import descendant_pids


def cpu_model() -> str:
    from radixlm.kernels.cpu_build import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, RAM, library versions and torch threads of this machine."""
    import torch

    mem_total = 0
    try:
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {
        "hostname": platform.node(), "cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
        "mem_total_gib": round(mem_total / 2**30, 1), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": _cpu_flags(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_flags() -> list[str]:
    """The CPU features that decide bf16 matmul speed (AMX, AVX512-BF16, AVX512F)."""
    wanted = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def read_cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies summed over all cores, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)     # idle + iowait
    total = sum(parts[:8])                                     # guest time is already in user
    return total - idle, total


def wait_for_quiet(max_s: float = 15.0, busy_below: float = 0.10, window_s: float = 0.25) -> float:
    """Waits until the whole machine was less than `busy_below` busy over one `window_s` window (at
    most `max_s`); returns the seconds waited. A server can keep computing after its last response
    (vLLM's CPU engine spun one core for 1-1.3 s after each run on a 2-core EPYC), so a run started
    right after the other server's would begin under its load: side by side, each run waits."""
    start = time.monotonic()
    prev = read_cpu_times()
    while time.monotonic() - start < max_s:
        time.sleep(window_s)
        now = read_cpu_times()
        if now[1] > prev[1] and (now[0] - prev[0]) / (now[1] - prev[1]) < busy_below:
            break
        prev = now
    return time.monotonic() - start


def _cpu_jiffies(pid: int) -> int | None:
    """utime + stime of a process in clock ticks, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def process_tree(root: int) -> dict[int, int]:
    """pid -> cpu jiffies for `root` and all its descendants."""
    jiffies = {pid: _cpu_jiffies(pid) for pid in [root, *descendant_pids(root)]}
    return {pid: j for pid, j in jiffies.items() if j is not None}


def rss_bytes(pid: int, peak: bool = False) -> int:
    """Resident set size of a process (VmHWM, its lifetime peak, with `peak=True`); 0 if gone."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_breakdown(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM (peak), RssAnon (heap: tensors, KV) and RssFile (mapped files, e.g. mmap'd
    safetensors) of a process, in MiB; empty when the process is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


@dataclass
class LoadMonitor:
    """Samples whole-machine and own-process-tree CPU use in a background thread.

    with LoadMonitor() as load: ...run...
    load.summary() -> {"busy_fraction", "own_busy_fraction", "other_busy_fraction", ...}

    Fractions are of all cores (1.0 = every core busy). `own` counts this process and its
    descendants, `extra_pids` (a server started elsewhere) and theirs.
    """

    interval: float = 0.5
    extra_pids: list[int] = field(default_factory=list)
    _first: dict[int, int] = field(default_factory=dict)
    _last: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _busy_fracs: list[float] = field(default_factory=list)

    def __enter__(self) -> LoadMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = read_cpu_times()
        self._first = self._sample_tree()
        self._last = dict(self._first)
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._thread.start()

    def _sample_tree(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for root in [os.getpid(), *self.extra_pids]:
            out.update(process_tree(root))
        return out

    def _run(self) -> None:
        prev = read_cpu_times()
        while not self._stop.wait(self.interval):
            self._record(prev)
            prev = read_cpu_times()

    def _record(self, prev: tuple[int, int]) -> None:
        now = read_cpu_times()
        if now[1] > prev[1]:
            self._busy_fracs.append((now[0] - prev[0]) / (now[1] - prev[1]))
        for pid, jiffies in self._sample_tree().items():
            self._last[pid] = max(jiffies, self._last.get(pid, 0))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.cpu1 = read_cpu_times()
        for pid, jiffies in self._sample_tree().items():
            self._last[pid] = max(jiffies, self._last.get(pid, 0))
        self.t1 = time.monotonic()

    def summary(self) -> dict[str, Any]:
        busy = self.cpu1[0] - self.cpu0[0]
        total = max(self.cpu1[1] - self.cpu0[1], 1)
        own = sum(j - self._first.get(pid, 0) for pid, j in self._last.items())
        busy_frac = busy / total
        own_frac = min(own / total, busy_frac)
        return {
            "wall_s": round(self.t1 - self.t0, 3), "cores": os.cpu_count(),
            "busy_fraction": round(busy_frac, 3), "own_busy_fraction": round(own_frac, 3),
            "other_busy_fraction": round(busy_frac - own_frac, 3),
            "max_busy_fraction_sampled": round(max(self._busy_fracs), 3) if self._busy_fracs else None,
            "loadavg_1m_at_end": os.getloadavg()[0],
        }
