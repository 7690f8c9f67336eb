"""Fused MoE experts for CPUs with AVX512 or AVX2 (C++ extension), built on first use and cached.

    mod = load_cpu_moe()        # None when disabled, unsupported here, or the build failed
    y = mod.experts_forward(x, ids, weights, gate_up_ptrs, down_ptrs, intermediate)
        # x [n, H] bf16; ids [n, k] int64; weights [n, k] fp32; *_ptrs int64 [E]: data pointers of
        # each expert's gate_up [2I, H] and down [H, I] weights in kernels/cpu_gemm's packed layout

moe.h explains the steps: pairs sorted by expert, one packed gemm per expert over its rows (gemm.h's
microkernel, experts x output blocks spread over the threads), SiLU * up, the weighted sum in fp32.
runtime/layers/moe.py (SparseMoeBlock) uses it when every expert's weights are in the gemm layout;
its torch loop stays the fallback and the reference. Disabled with the gemm kernel
(`RADIXLM_DISABLE_CPU_GEMM=1`) or every kernel (`RADIXLM_DISABLE_CPU_KERNELS=1`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..cpu_build import load_extension, pick_isa
from ..cpu_gemm import gemm_enabled, gemm_flags

_KERNELS = Path(__file__).parent.parent
_HEADERS = [Path(__file__).parent / "moe.h", _KERNELS / "cpu_gemm" / "gemm.h", _KERNELS / "cpu_gemm" / "gemm_silu.h",
            _KERNELS / "cpu_ops" / "fused_ops.h", _KERNELS / "cpu_ops" / "parallel.h", _KERNELS / "cpu_attention" / "simd.h"]


@functools.cache
def load_cpu_moe():
    """The extension module, or None. Side effects: may compile it into the kernel cache (logged)."""
    if not gemm_enabled():
        return None
    return load_extension("cpu_moe", "fused MoE kernel", pick_isa(), [Path(__file__).parent / "moe.cpp"], _HEADERS,
                          extra_flags=gemm_flags())
