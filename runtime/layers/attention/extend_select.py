"""Which C++ kernel runs a bf16 CPU extend (prefill) attention, chosen by timing on this CPU once.

    choose(kernels, num_heads, num_kv_heads, head_dim)  # "brgemm" | "simd"; times the shape on first call
    runs(extend_lens)                                   # a batch cut into runs of like requests
    kernel_for(kernels, layer, run, q_dtype, kv_dtype)  # "decode" | "simd" | "brgemm" for one run
    last_choice()                                       # what the last choose() decided (the startup block)

Candidates: **simd** (paged_attention.h `extend`: AVX512/AVX2 FMAs; the only kernel for fp32 q/KV
and for decode) and **brgemm** (extend_brgemm.h: flash attention whose Q.K^T and P.V run in torch's
`cpublas::brgemm`, oneDNN's micro-kernel, on AMX tiles where the CPU has them, or in radixlm's
vdpbf16ps micro-kernel on AVX512-BF16 CPUs without AMX). On an AMX Xeon brgemm is 3-4x faster, on a
Zen 5 EPYC 4.6x (2,048-token prefill); on a CPU with neither it falls back to a plain gemm per block
product and the simd kernel may win, hence the timing, not the ISA flags. `--cpu-extend-kernel` / RADIXLM_CPU_EXTEND_KERNEL: `auto` measures; `brgemm` or `simd`
forces one for every bf16 extend.

Measuring: per head shape (heads, kv heads, head_dim), one request of TIME_EXTEND new tokens over
TIME_PREFIX cached ones (page size 1, slots shuffled), both kernels round-robin through
linear_select.time_passes (passes while another process took the CPU do not count; with no quiet
pass the CPU time per thread ranks them, kept for this process in linear_select.NOISY, not written).
The winner (ties within TIE go to simd) runs every request with at least MIN_ROWS new tokens;
shorter ones (speculative verifies, short follow-ups) stay on simd, which pads nothing (brgemm pads
each head's rows into 32-key tiles: on an AMX Xeon it loses below ~8 rows per request and wins
1.3-1.8x at 16), and the decodes of a mixed batch (one new token each) run the decode kernel. A
mixed batch is cut into runs of consecutive requests of one kind (`runs`; the planner puts decodes
first, then prefills), one kernel call per run, so a 320-token prompt admitted beside 63 decodes
still runs brgemm. Times are cached in linear_select's JSON file, keyed
by environment_key() (CPU model + flags, torch, threads, oneDNN cap), the cpu_attention sources'
hash and the head shape, so later starts on the same kind of machine time nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ....kernels import cpu_attention
from ... import env
from ..linear_select import (NOISY, cache_file, environment_key, load_cache, ranked_times, save_cache, sources_hash,
                             time_passes)
from .base import RadixAttention

logger = logging.getLogger(__name__)

KERNELS = ("simd", "brgemm")          # also the order ties go to
TIME_PREFIX = 512
TIME_EXTEND = 512
MIN_ROWS = 16                         # mean new tokens per request from which the winner runs
TIE = 0.03
PASSES = 3
MAX_PASSES = 12
MEASURE_BUDGET_S = 10.0


@dataclass
class Choice:
    """What choose() decided for one head shape, and why (µs per timed call; empty when forced)."""

    kernel: str
    shape: str                        # "9/3x64": heads / kv heads x head_dim
    how: str                          # "forced", "measured", "measured (CPU busy)", "cached"
    times: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        if self.how == "forced":
            return f"{self.kernel} (forced by --cpu-extend-kernel {self.kernel})"
        t = ", ".join(f"{k} {v / 1000:.1f} ms" for k, v in self.times.items())
        return (f"{self.kernel} from {MIN_ROWS} new tokens per request, simd below (auto, {self.how}: "
                f"{TIME_EXTEND} new over {TIME_PREFIX} cached, heads {self.shape}: {t})")


_choices: dict[tuple[int, int, int], Choice] = {}
_last: Choice | None = None


def last_choice() -> Choice | None:
    return _last


def machine_key() -> str:
    src = sources_hash(Path(cpu_attention.__file__).parent, "*.[ch]*")
    return f"attn_extend|{environment_key()}|cpu_attention={src}"


def _timing_inputs(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
    """The arguments after `out` of one extend call: TIME_EXTEND new tokens over TIME_PREFIX cached."""
    gen = torch.Generator().manual_seed(0)
    seq = TIME_PREFIX + TIME_EXTEND
    k_buf = (torch.randn(seq, num_kv_heads, head_dim, generator=gen) * 0.5).bfloat16()
    v_buf = torch.randn(seq, num_kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(seq, generator=gen).to(torch.int32).view(1, seq)
    q = torch.randn(TIME_EXTEND, num_heads, head_dim, generator=gen).bfloat16()
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return (q, k_buf, v_buf, table, i64(0), i64(TIME_PREFIX), i64(seq), i64(0, TIME_EXTEND), head_dim ** -0.5)


def measure(kernels, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[dict[str, float], bool]:
    """({kernel: µs per call}, quiet) for one extend of this head shape (module docstring)."""
    args = _timing_inputs(num_heads, num_kv_heads, head_dim)
    out = torch.empty_like(args[0])
    calls = {"simd": lambda: kernels.extend(out, *args), "brgemm": lambda: kernels.extend_brgemm(out, *args)}
    return ranked_times(time_passes(calls, 1, PASSES, MAX_PASSES, time.perf_counter() + MEASURE_BUDGET_S))


def pick(times: dict[str, float]) -> str:
    best = min(times.values())
    return next(k for k in KERNELS if times[k] <= best * (1 + TIE))


def choose(kernels, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """The extend kernel for bf16 layers of this head shape. Side effects (auto mode, first call per
    shape in this process): times both kernels unless the cache file has them (about a second),
    writes quiet times there, logs the choice."""
    global _last
    shape = (num_heads, num_kv_heads, head_dim)
    mode = env.CPU_EXTEND_KERNEL.get()
    if mode != "auto":
        _last = Choice(mode, f"{num_heads}/{num_kv_heads}x{head_dim}", "forced")
        return mode
    if shape not in _choices:
        key = f"{machine_key()}|heads={num_heads}/{num_kv_heads}|d={head_dim}|bf16|{TIME_EXTEND}+{TIME_PREFIX}"
        times, how = load_cache(cache_file()).get(key) or NOISY.get(key), "cached"
        if not times or set(times) != set(KERNELS):
            times, quiet = measure(kernels, *shape)
            how = "measured" if quiet else "measured while the CPU was busy, not cached"
            if quiet:
                save_cache(cache_file(), {key: times})
            else:
                NOISY[key] = times
        _choices[shape] = Choice(pick(times), f"{num_heads}/{num_kv_heads}x{head_dim}", how, times)
        logger.info("CPU extend attention, heads %s: %s", _choices[shape].shape, _choices[shape].summary())
    _last = _choices[shape]
    return _last.kernel


def runs(extend_lens: list[int]) -> list[tuple[int, int, str]]:
    """(b0, b1, kind) for runs of consecutive requests of one kind: "decode" (1 new token), "short"
    (fewer than MIN_ROWS) or "long"; one run of kind "any" for the whole batch when a kernel is forced."""
    if env.CPU_EXTEND_KERNEL.get() != "auto":
        return [(0, len(extend_lens), "any")]
    out: list[tuple[int, int, str]] = []
    for b, n in enumerate(extend_lens):
        kind = "decode" if n == 1 else "short" if n < MIN_ROWS else "long"
        if out and out[-1][2] == kind:
            out[-1] = (out[-1][0], b + 1, kind)
        else:
            out.append((b, b + 1, kind))
    return out


def kernel_for(kernels, layer: RadixAttention, kind: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The kernel ("decode", "simd" or "brgemm") for one run of `runs`."""
    if kind == "decode":
        return "decode"
    if not brgemm_takes(q_dtype, kv_dtype, layer.head_dim):
        return "simd"
    mode = env.CPU_EXTEND_KERNEL.get()
    if mode != "auto":
        return mode
    if kind == "short":
        return "simd"
    return choose(kernels, layer.num_heads, layer.num_kv_heads, layer.head_dim)


def brgemm_takes(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the brgemm kernel takes these dtypes and head size."""
    return q_dtype == torch.bfloat16 and kv_dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256

