"""Shared build helpers for radixlm's C++ CPU extensions (kernels/cpu_attention, cpu_ops, cpu_gemm, cpu_decoder).

`load_extension(...)` compiles sources with `torch.utils.cpp_extension.load` on first use into
`$RADIXLM_KERNEL_CACHE` (default ~/.cache/radixlm/kernels/<name>_<isa>_<hash>), one folder per
source/flags/torch version, so later processes only load the built library.

Each extension is one translation unit, so a build keeps one core busy for 25-50 s, and a first start
builds four to six of them. `start_builds(planned_builds(loaders))` compiles the ones not in the cache
yet in child processes, one per core at a time, while the caller goes on (loading weights): a loader
called meanwhile waits on that build's lock and then loads the library. A child runs `python -m
radixlm.kernels.cpu_build` with the very arguments the loader would pass to `load_extension`.

The SIMD path follows the CPU: AVX512 (avx512f/bw/vl/dq) or AVX2+FMA, read from /proc/cpuinfo;
`--cpu-kernel-isa` / `RADIXLM_CPU_KERNEL_ISA=avx2|avx512` forces one. `--disable-cpu-kernels` /
`RADIXLM_DISABLE_CPU_KERNELS=1` disables every extension (callers then use their torch code).
`--require-kernels` / `RADIXLM_REQUIRE_KERNELS=1` turns a failed build (or a CPU without AVX2/AVX512)
into a RuntimeError instead of a warning and the torch code. These switches are read from the
process environment through runtime/env.py (the launcher sets them in every child from the flags).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..runtime import env

logger = logging.getLogger(__name__)

ISA_FLAGS = {
    "avx512": ["-DRADIXLM_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-DRADIXLM_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
# Every extension is compiled with these, so kernels/cpu_decoder (which compiles all of them into one
# library) computes exactly what the separate extensions do. No contraction of a*b+c into one fma:
# the fused ops must round twice, as the eager torch code does.
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"}}


def kernels_disabled() -> bool:
    return env.DISABLE_CPU_KERNELS.get()


def cpuinfo_field(key: str) -> str | None:
    """The first /proc/cpuinfo line's value for `key` ("flags", "model name"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


def pick_isa(flags: set[str] | None = None) -> str | None:
    """The best SIMD path this CPU runs ('avx512', 'avx2'), or None."""
    flags = cpu_flags() if flags is None else flags
    forced = env.CPU_KERNEL_ISA.get()
    for isa in ([forced] if forced else ["avx512", "avx2"]):
        if isa in ISA_NEEDS and ISA_NEEDS[isa] <= flags:
            return isa
    return None


def kernel_cache_root() -> Path:
    """$RADIXLM_KERNEL_CACHE, default ~/.cache/radixlm/kernels (not created here)."""
    return Path(env.KERNEL_CACHE.get() or Path.home() / ".cache" / "radixlm" / "kernels")


def cpu_model_name() -> str:
    """/proc/cpuinfo's "model name" (e.g. "AMD EPYC"), or "unknown"."""
    return cpuinfo_field("model name") or "unknown"


def build_dir(kind: str, isa: str, hashed_files: list[Path], flags: list[str]) -> Path:
    """The cache folder for one build: keyed on the sources' paths and bytes, the flags and torch's version
    (so two checkouts sharing the cache do not rebuild each other's builds).
    Side effect: creates the folder."""
    h = hashlib.sha256()
    for path in hashed_files:   # the path too: ninja rebuilds whenever build.ninja names other paths
        h.update(str(path.resolve()).encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    d = kernel_cache_root() / f"{kind}_{isa}_{h.hexdigest()[:16]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_extension(kind: str, what: str, isa: str | None, sources: list[Path], headers: list[Path],
                   extra_flags: tuple[str, ...] = ()):
    """Builds (first time only) and imports extension `radixlm_<kind>_<isa>`; None if disabled or on failure.

    `what` names the kernels in log lines ("CPU attention kernels"). Side effects: may compile into
    the cache folder (tens of seconds) and logs that it does; logs one warning on failure, or raises
    RuntimeError instead under RADIXLM_REQUIRE_KERNELS.
    """
    if kernels_disabled():
        return None
    isa = isa or pick_isa()
    if isa is None:
        return _unavailable(f"{what} need AVX2+FMA or AVX512")
    if _planned is not None:   # planned_builds asks what this loader would build: nothing is built or loaded
        _planned.append({"kind": kind, "what": what, "isa": isa, "sources": [str(p) for p in sources],
                         "headers": [str(p) for p in headers], "extra_flags": list(extra_flags)})
        return None
    folder, name, flags = _build_of(kind, isa, sources, headers, extra_flags)
    fresh = not _built(folder, name)
    if fresh:
        logger.info("Compiling %s (%s) into %s; first use only, about a minute", what, isa, folder)
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        include_dirs = sorted({str(p.parent) for p in headers})
        with build_lock(folder):
            mod = load(name=name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       extra_include_paths=include_dirs, build_directory=str(folder), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure falls back to torch code
        return _unavailable(f"{what} failed to build ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''})")
    if fresh:
        logger.info("%s (%s) built in %.1f s", what, isa, time.perf_counter() - t0)
    return mod


def _build_of(kind: str, isa: str, sources: list[Path], headers: list[Path],
              extra_flags: tuple[str, ...] | list[str]) -> tuple[Path, str, list[str]]:
    """(cache folder, module name, compiler flags) of one build."""
    flags = [*COMMON_FLAGS, *ISA_FLAGS[isa], *extra_flags]
    return build_dir(kind, isa, [*sources, *headers], flags), f"radixlm_{kind}_{isa}", flags


def _built(folder: Path, name: str) -> bool:
    return any(folder.glob(f"{name}*.so"))


_planned: list[dict] | None = None   # set by planned_builds while it asks the loaders what they would build


def planned_builds(loaders: list[Callable[[], object]]) -> list[dict]:
    """What these loaders would compile on their first call and is not in the cache yet.

    Each loader is a kernel package's cached loader (`load_cpu_gemm`) or a functools.partial of one
    with its arguments (`partial(load_cpu_attention, "avx2")`); its uncached body runs in a dry mode
    in which `load_extension` records its arguments instead of building or loading. Not thread-safe:
    call it before other threads load kernels."""
    global _planned
    _planned = []
    try:
        for loader in loaders:
            fn, args = (loader.func, loader.args) if isinstance(loader, functools.partial) else (loader, ())
            getattr(fn, "__wrapped__", fn)(*args)
    finally:
        plans, _planned = _planned, None
    unique = list({json.dumps(p, sort_keys=True): p for p in plans}.values())
    return [p for p in unique if not _built(*_build_of(p["kind"], p["isa"], [Path(f) for f in p["sources"]],
                                                       [Path(f) for f in p["headers"]], p["extra_flags"])[:2])]


def start_builds(plans: list[dict], jobs: int | None = None) -> threading.Thread | None:
    """Compiles `plans` (planned_builds) in child processes, `jobs` at a time (default: the cores this
    process may use), from a background thread, which it returns (None when there is nothing to build). Side effects:
    logs what it builds and how long that took. A child that fails changes nothing: the loader's own
    call builds again and reports the error."""
    if not plans:
        return None
    jobs = max(1, min(len(plans), jobs or len(os.sched_getaffinity(0))))
    logger.info("Compiling %d C++ CPU extensions (%s), %d at a time; first start only, about %d s",
                len(plans), ", ".join(f"{p['kind']} {p['isa']}" for p in plans), jobs, 40 * len(plans) // jobs)
    thread = threading.Thread(target=_run_builds, args=(plans, jobs), name="radixlm-kernel-builds", daemon=True)
    thread.start()
    return thread


def _run_builds(todo: list[dict], jobs: int) -> None:
    t0 = time.perf_counter()
    pending, running = list(todo), []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = [sys.executable, "-m", "radixlm.kernels.cpu_build", json.dumps(pending.pop(0))]
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.2)
        running = [p for p in running if p.poll() is None]
    logger.info("C++ CPU extensions compiled in %.1f s", time.perf_counter() - t0)


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Holds an OS file lock (flock) on `folder` for one build-or-load.

    torch's loader guards a build with a `lock` file that it waits on forever, and a process killed
    mid-build (a stopped test run, a killed server) leaves that file behind, so every later process
    hung. The flock is released by the kernel when its holder dies; every radixlm process takes it
    before loading, so a `lock` file found while holding it is stale and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "radixlm.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("Removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unavailable(problem: str) -> None:
    """Warns and returns None (the caller uses its torch code); raises under RADIXLM_REQUIRE_KERNELS."""
    if env.REQUIRE_KERNELS.get():
        raise RuntimeError(f"{problem}, and --require-kernels / {env.REQUIRE_KERNELS.name} is set")
    logger.warning("%s; using the torch code", problem)
    return None


if __name__ == "__main__":      # one build of start_builds: python -m radixlm.kernels.cpu_build '{"kind": ...}'
    plan = json.loads(sys.argv[1])
    built = load_extension(plan["kind"], plan["what"], plan["isa"], [Path(p) for p in plan["sources"]],
                           [Path(p) for p in plan["headers"]], tuple(plan["extra_flags"]))
    sys.exit(0 if built is not None else 1)
