"""The decoder layers of a CPU decode step in one C++ call (extension), built on first use and cached.

    mod = load_cpu_decoder()          # None when disabled, unsupported here, or the build failed
    dec = mod.Decoder(num_heads, num_kv_heads, head_dim, eps, scaling, cos_cache, sin_cache, final_norm)
    dec.add_layer(input_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down, k_cache, v_cache)
    dec.add_moe_layer(input_norm, post_norm, q_norm, k_norm, qkv, o, moe, k_cache, v_cache)   # sparse MLP
    hidden = dec.forward(embeddings, positions, out_cache_loc, req_to_token, rows, seq_lens)
    hidden = dec.forward_split(embeddings, positions, out_cache_loc, req_to_token, rows, seq_lens, parts)  # same bits
    hidden = dec.extend(embeddings, positions, out_cache_loc, req_to_token, [mod.ExtendRun(...), ...])  # prefill

Each linear is a tuple (weight, bias or None, out_features, kind): kind 0 is a dense [out, in]
weight (at::linear), 1 kernels/cpu_gemm's layout, 2 oneDNN's packed layout
(mkldnn::_linear_pointwise), 100 + a ggml type kernels/cpu_quant's repacked GGUF layout (on CPUs
with AVX512-VNNI; `mod.with_quant` says whether it was compiled in). A sparse layer's `moe` is the
router weight, top-k settings, kernels/cpu_moe's expert pointer tables and Qwen2-MoE's shared expert
(decoder.cpp's MoeArgs); it needs the gemm kernel (`mod.with_gemm`). decoder.cpp has the layer
sequence; it compiles the kernels of cpu_ops, cpu_attention, cpu_gemm and cpu_moe into one library
from their headers, with the flags those extensions use, so it computes what they compute. The model side (which
models and settings it takes) is runtime/model_executor/cpu_decoder.py.

`RADIXLM_DISABLE_CPU_DECODER=1` disables it; `RADIXLM_DISABLE_CPU_KERNELS=1` disables every kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ...runtime import env
from ..cpu_build import load_extension, pick_isa
from ..cpu_gemm import gemm_enabled, gemm_flags
from ..cpu_quant import QUANT_FLAGS, cpu_supports_quant

_KERNELS = Path(__file__).parent.parent
_HEADERS = [_KERNELS / "cpu_ops" / "fused_ops.h", _KERNELS / "cpu_ops" / "parallel.h",
            _KERNELS / "cpu_attention" / "paged_attention.h",
            _KERNELS / "cpu_attention" / "extend_brgemm.h", _KERNELS / "cpu_attention" / "dpbf16_gemm.h",
            _KERNELS / "cpu_attention" / "decode_dpbf16.h",
            _KERNELS / "cpu_attention" / "simd.h", _KERNELS / "cpu_gemm" / "gemm.h",
            _KERNELS / "cpu_gemm" / "gemm_silu.h", _KERNELS / "cpu_moe" / "moe.h", _KERNELS / "cpu_quant" / "quant.h",
            _KERNELS / "cpu_quant" / "kquant.h", _KERNELS / "cpu_quant" / "xquant.h"]


@functools.cache
def load_cpu_decoder():
    """The extension module, or None. Side effects: may compile it into the kernel cache (logged)."""
    if env.DISABLE_CPU_DECODER.get():
        return None
    flags = (*gemm_flags(), "-DRADIXLM_WITH_GEMM") if gemm_enabled() else ()
    if cpu_supports_quant():
        flags = (*flags, *QUANT_FLAGS, "-DRADIXLM_WITH_QUANT")
    return load_extension("cpu_decoder", "one-call CPU decoder", pick_isa(), [Path(__file__).parent / "decoder.cpp"],
                          _HEADERS, extra_flags=flags)
