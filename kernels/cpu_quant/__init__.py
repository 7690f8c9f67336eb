"""GGUF block-quantized linear layers for CPUs with AVX512-VNNI (C++ extension), built on first use and cached.

    mod = load_cpu_quant()                       # None when disabled, unsupported here, or the build failed
    out = torch.empty(mod.packed_bytes(t, n, k), dtype=torch.uint8)
    mod.repack(raw, t, n, k, out)                # raw: the file's bytes of an [n, k] tensor of GGUF type t
    y = mod.linear(x, out, t, n)                 # x [m, k] bf16/fp32 -> [m, n]

quant.h explains the layout and the kernel. The types are ggml's numbers (gguf.GGMLQuantizationType):
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; and through the k_* bindings (kquant.h, 256-weight super-blocks)
Q4_K, Q5_K, Q6_K. runtime/layers/quant_linear.py holds the weights and falls back to
dequantize-then-matmul in torch where this is off. `RADIXLM_DISABLE_CPU_KERNELS=1` disables it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..cpu_build import cpu_flags, load_extension, pick_isa

_SRC_DIR = Path(__file__).parent
QUANT_FLAGS = ("-mavx512vnni",)
KERNEL_TYPES = frozenset({2, 3, 6, 7, 8})   # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
KQUANT_TYPES = frozenset({12, 13, 14})      # Q4_K, Q5_K, Q6_K (kquant.h; k_* bindings but linear)


def cpu_supports_quant(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return pick_isa(flags) == "avx512" and "avx512_vnni" in flags


@functools.cache
def load_cpu_quant():
    """The extension module, or None. Side effects: may compile it into the kernel cache (logged)."""
    if not cpu_supports_quant():
        return None
    return load_extension("cpu_quant", "GGUF quantized linear kernel", "avx512", [_SRC_DIR / "quant.cpp"],
                          [_SRC_DIR / n for n in ("xquant.h", "quant.h", "kquant.h", "qgemm.h")], extra_flags=QUANT_FLAGS)
