"""CPU paged attention kernels (C++ extension), built on first use and cached.

`load_cpu_attention()` returns the compiled module, or None (with one warning) when it is
disabled or cannot be built; callers then use the torch code. The module has:

    decode(out, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, num_splits, window_left=-1,
           logit_cap=0.0)
    extend(out, q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, seq_lens, qo_indptr, scale,
           window_left=-1, logit_cap=0.0)
    extend_brgemm(...)      # extend's arguments and result, bf16 only, on the matrix units (extend_brgemm.h)
    decode_num_splits(max_keys), isa()
    extend_brgemm_micro()   # what its products run on: "amx", "avx512_bf16" (dpbf16_gemm.h) or "gemm"
    force_extend_brgemm_micro(name)   # tests: "gemm" or the best one, until "auto"
    decode_micro(head_dim)  # what bf16 decode multiplies with: "avx512_bf16" (decode_dpbf16.h) or "fma"
    set_decode_dpbf16(allowed)        # tests, benchmarks: False sends bf16 decode to the fp32 loop

Which extend kernel a bf16 layer runs is measured, not assumed: runtime/layers/attention/extend_select.py.

The three ops are registered as `torch.ops.radixlm.cpu_paged_decode` / `cpu_paged_extend` / `cpu_paged_extend_brgemm`
(custom ops that mutate `out`) so a torch.compile'd forward keeps them in one graph.

Both attention ops read K/V in place through `req_to_token[req_pool_indices[b], :seq_lens[b]]`
and write `out` (q's shape and dtype); see paged_attention.h for the exact contract. With
`window_left` >= 0 (a sliding window), a query at position i sees only keys [i - window_left, i];
with `logit_cap` > 0 (Gemma 2) each score s becomes logit_cap * tanh(s / logit_cap).

Building, caching and the ISA choice (AVX512 or AVX2, `RADIXLM_CPU_KERNEL_ISA`, the
`RADIXLM_DISABLE_CPU_KERNELS=1` switch) are shared with the other extensions: see kernels/cpu_build.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from ..cpu_build import cpu_flags, kernels_disabled, load_extension, pick_isa

__all__ = ["cpu_flags", "kernels_disabled", "load_cpu_attention", "pick_isa"]

_SRC_DIR = Path(__file__).parent


@functools.cache
def load_cpu_attention(isa: str | None = None):
    """Builds (first time only) and imports the extension; None if disabled or on failure.

    Side effects: may compile into the cache folder (tens of seconds) and logs that it does.
    """
    mod = load_extension("cpu_attention", "CPU attention kernels", isa, [_SRC_DIR / "paged_attention.cpp"],
                         [_SRC_DIR / "paged_attention.h", _SRC_DIR / "extend_brgemm.h", _SRC_DIR / "dpbf16_gemm.h",
                          _SRC_DIR / "decode_dpbf16.h",
                          _SRC_DIR / "simd.h", _SRC_DIR.parent / "cpu_ops" / "parallel.h"])
    if mod is not None:
        _register_custom_ops(mod)
    return mod


_registered: list = []   # the module behind torch.ops.radixlm.cpu_paged_* (first one loaded)


def _register_custom_ops(mod) -> None:
    """Registers the torch.compile-visible ops once per process (they call the first module loaded)."""
    if _registered:
        return
    _registered.append(mod)

    @torch.library.custom_op("radixlm::cpu_paged_decode", mutates_args=("out",), device_types="cpu")
    def cpu_paged_decode(out: Tensor, q: Tensor, k_buf: Tensor, v_buf: Tensor, req_to_token: Tensor,
                         req_pool_indices: Tensor, seq_lens: Tensor, scale: float, num_splits: int,
                         window_left: int = -1, logit_cap: float = 0.0) -> None:
        _registered[0].decode(out, q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, num_splits,
                              window_left, logit_cap)

    cpu_paged_decode.register_fake(lambda *args: None)
    for method in ("extend", "extend_brgemm"):
        _register_extend_op(method)


def _register_extend_op(method: str) -> None:
    """Registers torch.ops.radixlm.cpu_paged_<method>, calling the module's `method` (extend or
    extend_brgemm: the same arguments)."""

    @torch.library.custom_op(f"radixlm::cpu_paged_{method}", mutates_args=("out",), device_types="cpu")
    def extend_op(out: Tensor, q: Tensor, k_buf: Tensor, v_buf: Tensor, req_to_token: Tensor,
                  req_pool_indices: Tensor, prefix_lens: Tensor, seq_lens: Tensor, qo_indptr: Tensor,
                  scale: float, window_left: int = -1, logit_cap: float = 0.0) -> None:
        getattr(_registered[0], method)(out, q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens,
                                        seq_lens, qo_indptr, scale, window_left, logit_cap)

    extend_op.register_fake(lambda *args: None)
