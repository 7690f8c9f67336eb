"""bf16 linear layers for CPUs with AVX512-BF16 or AVX2 (C++ extension), built on first use and cached.

    mod = load_cpu_gemm()                       # None when disabled, unsupported here, or the build failed
    out = torch.empty(mod.packed_numel(n, k), dtype=torch.bfloat16)   # any contiguous bf16 buffer
    mod.pack(w, out)                            # w [n, k] bf16, k even -> blocked k-pair layout
    y = mod.linear(x, out, n, bias)             # x [m, k] bf16 -> [m, n] bf16
    a = mod.linear_silu_mul(x, gu, i)           # gu packed from [gate; up] [2i, k]: silu(gate) * up [m, i]

gemm.h explains the layout. It multiplies with vdpbf16ps where the CPU has AVX512-BF16 and with
fp32 fused multiply-adds on the widened weights elsewhere (AVX512F or AVX2 + FMA: plain bf16 matmuls
in torch run at a tenth of the fp32 speed there). runtime/layers/packed_linear.py packs bf16 linear
weights this way after loading, into one arena of 2 MiB pages (runtime/mem_cache/huge_pages.py),
where runtime/layers/linear_select.py's timing picks this kernel.

`RADIXLM_DISABLE_CPU_GEMM=1` disables just this kernel; `RADIXLM_DISABLE_CPU_KERNELS=1` every kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ...runtime import env
from ..cpu_build import cpu_flags, load_extension, pick_isa

_SRC_DIR = Path(__file__).parent


def cpu_supports_gemm(flags: set[str] | None = None) -> bool:
    return pick_isa(cpu_flags() if flags is None else flags) is not None


def gemm_flags(flags: set[str] | None = None) -> tuple[str, ...]:
    """Compiler flags added to the ISA's for every library that compiles gemm.h: vdpbf16ps where the
    AVX512 path runs on a CPU that has it (gemm.h then multiplies with it; else the FMA path)."""
    flags = cpu_flags() if flags is None else flags
    return ("-mavx512bf16",) if pick_isa(flags) == "avx512" and "avx512_bf16" in flags else ()


# gemm_silu.h uses the fused ops' SiLU (kernels/cpu_ops) so that its result is silu_and_mul's
HEADERS = [_SRC_DIR / "gemm.h", _SRC_DIR / "gemm_silu.h", _SRC_DIR.parent / "cpu_ops" / "fused_ops.h",
           _SRC_DIR.parent / "cpu_ops" / "parallel.h",
           _SRC_DIR.parent / "cpu_attention" / "simd.h"]


def gemm_enabled() -> bool:
    """This CPU runs the kernel and RADIXLM_DISABLE_CPU_GEMM is not set."""
    return not env.DISABLE_CPU_GEMM.get() and cpu_supports_gemm()


@functools.cache
def load_cpu_gemm():
    """The extension module, or None. Side effects: may compile it into the kernel cache (logged)."""
    if not gemm_enabled():
        return None
    return load_extension("cpu_gemm", "bf16 GEMM kernel", pick_isa(), [_SRC_DIR / "gemm.cpp"], HEADERS,
                          extra_flags=gemm_flags())
