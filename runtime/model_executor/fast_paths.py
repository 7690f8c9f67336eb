"""Which CPU fast paths one scheduler's model runner uses, and why: the startup block's lines.

    fast_paths(runner)   -> {"ISA": "avx512 (the best this CPU runs)", "CPU gemm": "on ...", ...}

Reported by `ModelRunner.info()`, so the launcher prints it once at startup (with its own thread
and preload lines, see entrypoints/server_info.format_fast_paths) and /get_server_info returns it.
Reads only: the kernels are loaded (cached per process) before the runner asks.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels import cpu_ops
from ...kernels.cpu_amx import prepare_onednn_isa
from ...kernels.cpu_build import pick_isa
from ...kernels.cpu_gemm import cpu_supports_gemm, gemm_flags, load_cpu_gemm
from .. import env
from ..layers.attention import extend_select
from ..layers.linear_select import last_selection
from ..layers.packed_linear import GemmWeight
from ..layers.quant_linear import QuantWeight
from ..mem_cache.huge_pages import transparent_huge_pages
from .cpu_decoder import CpuDecoder, _unsupported_reason

NOT_BUILT = "did not build or this CPU lacks its ISA (see the warning above)"


def _flag(var: env.EnvVar) -> str:
    return "--" + str(var.field).replace("_", "-")


def _off_reason(own: env.EnvVar | None) -> str:
    """Why a kernel is not loaded: its own switch, the switch of every kernel, or its build."""
    for var in (own, env.DISABLE_CPU_KERNELS):
        if var is not None and var.get():
            return f"{_flag(var)} / {var.name}"
    return NOT_BUILT


def fast_paths(runner: Any) -> dict[str, str]:
    """One entry per fast path: "on (...)" or "off (why)". CUDA runners get one line."""
    args = runner.server_args
    if runner.device.type != "cpu":
        return {"device": f"{runner.device}: attention backend {args.attention_backend}; the CPU fast paths "
                          f"do not apply"}
    isa, forced = pick_isa(), env.CPU_KERNEL_ISA.get()
    kernels_off = env.DISABLE_CPU_KERNELS.get()
    return {
        "ISA": ("none (--disable-cpu-kernels)" if kernels_off else
                f"{isa} ({'forced by --cpu-kernel-isa' if forced else 'the best this CPU runs'})" if isa else
                "none (this CPU has no AVX2+FMA or AVX512)"),
        "attention kernels": _attention(runner),
        "extend attention": _extend_kernel(runner),
        "fused ops": "on (RMSNorm, SiLU-and-mul, rotary in C++)" if cpu_ops.enabled()
                     else f"off ({_off_reason(env.DISABLE_FUSED_OPS)})",
        "CPU gemm": _gemm(),
        "CPU linear kernel": _linear_kernel(runner),
        "AMX": prepare_onednn_isa().text,
        "packed weights": _packed(runner),
        "one-call decoder": _decoder(runner),
        "huge pages": f"transparent huge pages: {transparent_huge_pages()}",
        "torch threads": str(torch.get_num_threads()),
    }


def _attention(runner: Any) -> str:
    backend = runner.attn_backend
    if getattr(backend, "kernels", None) is not None:
        return "on (C++ paged attention, K/V read in place)"
    if runner.server_args.attention_backend != "torch_native":
        return f"off (--attention-backend {runner.server_args.attention_backend})"
    return f"off ({_off_reason(None)}); the torch gather + SDPA code runs"


def _extend_kernel(runner: Any) -> str:
    """Which C++ kernel runs extend (prefill) attention (--cpu-extend-kernel), and why."""
    backend = runner.attn_backend
    if getattr(backend, "kernels", None) is None:
        return "none (no C++ attention kernels, see above)"
    choice = extend_select.last_choice()
    if runner.dtype != torch.bfloat16 or choice is None:
        return f"simd (AVX512/AVX2; the brgemm kernel takes bf16 only, this model runs {runner.dtype})"
    micro = {"amx": "oneDNN's brgemm on AMX tiles", "avx512_bf16": "radixlm's vdpbf16ps micro-kernel (no AMX)",
             "gemm": "no AMX or AVX512-BF16: brgemm's plain gemm fallback"}[backend.kernels.extend_brgemm_micro()]
    return f"{choice.summary()}; brgemm products: {micro}"


def _gemm() -> str:
    if load_cpu_gemm() is not None:
        return f"on (bf16 gemm, {'vdpbf16ps' if gemm_flags() else 'fp32 FMAs on widened weights'})"
    if not (env.DISABLE_CPU_GEMM.get() or env.DISABLE_CPU_KERNELS.get()) and not cpu_supports_gemm():
        return "off (this CPU has no AVX2); packed bf16 weights use oneDNN's layout"
    return f"off ({_off_reason(env.DISABLE_CPU_GEMM)}); packed bf16 weights use oneDNN's layout"


def _linear_kernel(runner: Any) -> str:
    """How the bf16/fp16 linear weights' kernels were chosen (--cpu-linear-kernel)."""
    sel = last_selection()
    if sel is None:
        return "none chosen (no bf16/fp16 weight was packed: plain F.linear)"
    return sel.summary()


def _packed(runner: Any) -> str:
    args = runner.server_args
    packed = [m.packed_weight for m in runner.model.modules() if getattr(m, "packed_weight", None) is not None]
    if packed:
        gemm = sum(isinstance(p, GemmWeight) for p in packed)
        quant = sum(isinstance(p, QuantWeight) for p in packed)
        plain = sum(getattr(m, "linear_kernel", None) == "torch" for m in runner.model.modules())
        layouts = [f"{gemm} in the gemm layout" if gemm else "", f"{quant} GGUF-quantized" if quant else "",
                   f"{len(packed) - gemm - quant} in oneDNN's" if len(packed) - gemm - quant else ""]
        return (f"on ({len(packed)} linear weights: {', '.join(x for x in layouts if x)}"
                f"{f'; {plain} plain (F.linear measured faster)' if plain else ''})")
    if args.disable_packed_weights:
        return "off (--disable-packed-weights / RADIXLM_DISABLE_PACKED_WEIGHTS)"
    if args.enable_torch_compile:
        return "off (--enable-torch-compile: inductor packs the weights of the graphs it compiles)"
    return f"off (no bf16/fp16 linear weight that oneDNN packs on this CPU; dtype {runner.dtype})"


def _decoder(runner: Any) -> str:
    args = runner.server_args
    if isinstance(runner.decode_forward, CpuDecoder):
        return "on (decode runs every decoder layer in one C++ call)"
    if args.enable_torch_compile:
        return "off (--enable-torch-compile)"
    if args.disable_cpu_decoder:
        return "off (--disable-cpu-decoder / RADIXLM_DISABLE_CPU_DECODER)"
    reason = _unsupported_reason(runner.model, runner.kv_cache, runner.attn_backend, args.tp_size)
    return f"off ({reason or _off_reason(env.DISABLE_CPU_DECODER)})"
