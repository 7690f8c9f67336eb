"""Fused CPU ops for the decoder's elementwise work (C++ extension), built on first use and cached.

`load_cpu_ops()` returns the compiled module, or None (with one warning) when it is disabled or
cannot be built; the layers then run their torch code. The module has (T = the activation dtype,
fp32, bf16 or fp16; activations [n, d] or [n, m, d] with a contiguous last dim, any row strides):

    rms_norm(out, x, weight, eps)                    out = w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(T)
    fused_add_rms_norm(x, residual, weight, eps)     in place: residual = x + residual; x = rms_norm(residual)
    silu_and_mul(out, x)                             x = [gate | up]: out = silu(gate) * up
    rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim)
                                                     in place, neox style: x = x*cos + rotate_half(x)*sin,
                                                     cos/sin = cache[positions] (fp32 [max_pos, rotary_dim/2]) cast to T;
                                                     the first rotary_dim lanes of each head rotate (partial rotary)
    argmax_rows(out, x)                              out (int64 [n]) = torch.max(x, dim=-1).indices for x [n, d]:
                                                     the first index of the max, of the first NaN in a row with one

Rounding follows the eager torch code (and HF transformers) exactly: the residual sum is rounded to T
once; RMSNorm rounds after normalizing and after the weight multiply; silu(gate) is rounded before
`* up`; in rotary each product and each sum is rounded. RMSNorm adds its fp32 squares in the order
of torch's sum kernel (8-wide lanes, 4-way interleaved, summed in levels), so its mean is torch's to
the bit; SiLU uses the exp torch's vector code uses (Sleef's). The results equal the eager torch code
bit for bit in bf16, fp16 and fp32 (tests/unit/test_cpu_fused_ops.py).

`call(name, *args)` runs one op: through the torch custom op `torch.ops.radixlm.cpu_<name>` while
torch.compile traces (the graph stays whole), else straight into the extension. `fits(*tensors)`
says whether the ops take these tensors.

`RADIXLM_DISABLE_FUSED_OPS=1` disables just these ops; `RADIXLM_DISABLE_CPU_KERNELS=1` disables
every C++ kernel. Building and caching: kernels/cpu_build.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from ...runtime import env
from ..cpu_build import load_extension

_SRC_DIR = Path(__file__).parent
_SIMD_H = _SRC_DIR.parent / "cpu_attention" / "simd.h"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_loaded: dict = {}   # "mod": the module used by `call` (loaded once per process)


@functools.cache
def load_cpu_ops(isa: str | None = None):
    """Builds (first time only) and imports the extension; None if disabled or on failure.

    Side effects: may compile into the kernel cache folder (tens of seconds) and logs that it does;
    registers the torch custom ops on first success.
    """
    if env.DISABLE_FUSED_OPS.get():
        return None
    mod = load_extension("cpu_ops", "fused CPU ops", isa, [_SRC_DIR / "fused_ops.cpp"],
                         [_SRC_DIR / "fused_ops.h", _SIMD_H])
    if mod is not None:
        _register_custom_ops(mod)
    return mod


def enabled() -> bool:
    """Whether the fused ops are loaded (loads them on the first call)."""
    if "mod" not in _loaded:
        _loaded["mod"] = load_cpu_ops()
    return _loaded["mod"] is not None


def fits(*tensors: Tensor) -> bool:
    """True when the ops are loaded and take these tensors: CPU, one dtype of fp32/bf16/fp16,
    1 to 3 dims with a contiguous last dim. (Called per layer per step: kept cheap.) Checks the
    tensors first, so tensors off the CPU (CUDA, meta) never trigger the extension's build."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1 or not 1 <= t.dim() <= 3:
            return False
    return enabled()


def call(name: str, *args) -> None:
    """Runs op `name` (its outputs are written in place; see the module docstring)."""
    if torch.compiler.is_compiling():
        getattr(torch.ops.radixlm, "cpu_" + name)(*args)
    else:
        getattr(_loaded["mod"], name)(*args)


_registered: list = []   # the module behind torch.ops.radixlm.cpu_* (first one loaded)


def _register_custom_ops(mod) -> None:
    """Registers the torch.compile-visible ops once per process (they call the first module loaded)."""
    if _registered:
        return
    _registered.append(mod)
    _loaded.setdefault("mod", mod)

    @torch.library.custom_op("radixlm::cpu_rms_norm", mutates_args=("out",), device_types="cpu")
    def cpu_rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
        _registered[0].rms_norm(out, x, weight, eps)

    @torch.library.custom_op("radixlm::cpu_fused_add_rms_norm", mutates_args=("x", "residual"), device_types="cpu")
    def cpu_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
        _registered[0].fused_add_rms_norm(x, residual, weight, eps)

    @torch.library.custom_op("radixlm::cpu_silu_and_mul", mutates_args=("out",), device_types="cpu")
    def cpu_silu_and_mul(out: Tensor, x: Tensor) -> None:
        _registered[0].silu_and_mul(out, x)

    @torch.library.custom_op("radixlm::cpu_rotary_embedding", mutates_args=("q", "k"), device_types="cpu")
    def cpu_rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_cache: Tensor, sin_cache: Tensor,
                             head_dim: int) -> None:
        _registered[0].rotary_embedding(positions, q, k, cos_cache, sin_cache, head_dim)

    @torch.library.custom_op("radixlm::cpu_argmax_rows", mutates_args=("out",), device_types="cpu")
    def cpu_argmax_rows(out: Tensor, x: Tensor) -> None:
        _registered[0].argmax_rows(out, x)

    for op in (cpu_rms_norm, cpu_fused_add_rms_norm, cpu_silu_and_mul, cpu_rotary_embedding, cpu_argmax_rows):
        op.register_fake(lambda *args: None)
