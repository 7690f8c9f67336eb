"""AMX tile state: ask Linux for it before oneDNN's first matmul, and cap oneDNN below AMX if refused.

CPUID can advertise AMX (`amx_tile` in /proc/cpuinfo) while the kernel has not granted this
process the tile data state: Linux hands it out per process on request
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), and a hypervisor or kernel may refuse.
An AMX instruction without the permission kills the process (SIGILL, "Illegal instruction").

    status = prepare_onednn_isa()     # once per process, before the first oneDNN matmul
    status.text                       # "granted", "not on this CPU", "refused (...): oneDNN capped at ..."

On a refusal, ONEDNN_MAX_CPU_ISA (through runtime/env.py) is set in this process's environment to
the best non-AMX level the CPU has, unless the user set it; oneDNN reads it once, at its first
primitive, so this must run before torch's first oneDNN op (ModelRunner calls it before loading).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

from ..runtime import env
from .cpu_build import cpu_flags

logger = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158              # x86-64 syscall number
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class AmxStatus:
    """advertised: CPUID lists amx_tile; granted: the kernel gave this process the tile state;
    onednn_cap: the ONEDNN_MAX_CPU_ISA this module set (None when it set nothing)."""

    advertised: bool
    granted: bool
    error: str | None = None
    onednn_cap: str | None = None

    @property
    def text(self) -> str:
        if not self.advertised:
            return "not on this CPU"
        if self.granted:
            return "granted (oneDNN may use AMX tiles)"
        cap = (f"oneDNN capped at {self.onednn_cap}" if self.onednn_cap else
               f"ONEDNN_MAX_CPU_ISA={env.ONEDNN_MAX_CPU_ISA.get()} left as set")
        return f"refused by the kernel ({self.error}): {cap}"


def _libc_syscall(*args: int) -> tuple[int, int]:
    """syscall(args...) through libc: (return value, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.syscall(*[ctypes.c_long(a) for a in args])
    return ret, ctypes.get_errno()


def request_tile_permission(syscall: Callable[..., tuple[int, int]] = _libc_syscall) -> tuple[bool, str | None]:
    """Asks for XFEATURE_XTILEDATA: (granted, error text). Tests pass a `syscall` that refuses."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"not x86-64 ({platform.machine()})"
    ret, err = syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if ret == 0:
        return True, None
    return False, f"arch_prctl(ARCH_REQ_XCOMP_PERM) errno {err} {os.strerror(err) if err else ''}".strip()


def non_amx_isa(flags: set[str]) -> str:
    """The best oneDNN ISA level below AMX that these CPU flags allow."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if "avx512_bf16" in flags:
            return "AVX512_CORE_BF16"
        return "AVX512_CORE_VNNI" if "avx512_vnni" in flags else "AVX512_CORE"
    return "AVX2_VNNI" if "avx_vnni" in flags else "AVX2"


def check_amx(flags: set[str] | None = None,
              syscall: Callable[..., tuple[int, int]] = _libc_syscall) -> AmxStatus:
    """Requests the tile state when the CPU advertises AMX; on refusal sets ONEDNN_MAX_CPU_ISA
    (unless already set) and logs a warning. Side effects: the syscall, maybe the process environment."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" not in flags:
        return AmxStatus(False, False)
    granted, error = request_tile_permission(syscall)
    if granted:
        return AmxStatus(True, True)
    cap = None
    if env.ONEDNN_MAX_CPU_ISA.get() is None:
        cap = non_amx_isa(flags)
        env.ONEDNN_MAX_CPU_ISA.set(cap)
    status = AmxStatus(True, False, error, cap)
    logger.warning("AMX advertised but the tile state was %s", status.text)
    return status


@functools.cache
def prepare_onednn_isa() -> AmxStatus:
    """check_amx() once per process (the permission lasts for the process)."""
    return check_amx()
