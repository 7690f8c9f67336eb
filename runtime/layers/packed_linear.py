"""Linear layers on CPU with their weights packed once, after loading, for a faster matmul.

A bf16 decode step at small batch is bound by reading the weights. `F.linear` on a plain row-major
weight makes oneDNN reorder (or read with a poor stride) the whole weight on every call. Packing
once avoids that, in one of two layouts; which one (or the plain weight and F.linear) each weight
gets is measured on this CPU per shape (runtime/layers/linear_select.py, `--cpu-linear-kernel`):

- **gemm** (bf16 weights; vdpbf16ps on AVX512-BF16 CPUs, fp32 FMAs on widened weights on AVX512/AVX2
  ones): kernels/cpu_gemm's blocked k-pair layout, all
  weights in one arena of 2 MiB pages. On this project's 2-core VM, SmolLM2-135M's 121 matmuls at
  batch 1 took 5.7-8.6 ms against 15-19 ms for oneDNN's packed matmul (4 KiB pages cost half the
  read bandwidth there), and it stays ahead up to batch 64 (benchmarks/README.md). The sums run in
  k order in fp32, so outputs equal F.linear's for most shapes and differ by bf16 rounding for the
  rest.
- **onednn** (any CPU oneDNN runs bf16/fp16 on, which excludes AVX2-only ones for bf16; AMX kernels
  where granted): oneDNN's own blocked
  layout (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`): bit-identical to
  F.linear. On an AMX Xeon it was 1.7x faster than gemm at batch 16 and 3x at prefill.
- **torch**: the weight stays plain; F.linear.

    pack_linear_weights(model)      # after load_weights: every layer with a `packed_weight` slot
    y = linear(x, layer.weight, layer.packed_weight, bias)

fp32 weights are left alone (F.linear goes to MKL's sgemm). Packing frees the dense weight unless
another module shares it (a tied LM head keeps the embedding table, and gets its own packed copy).
`--disable-packed-weights` (or `RADIXLM_DISABLE_PACKED_WEIGHTS=1`) keeps the plain path, and
`--enable-torch-compile` does too, since inductor packs the weights of the graphs it compiles.
`RADIXLM_DISABLE_CPU_GEMM=1` takes the gemm layout out of the candidates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.cpu_gemm import load_cpu_gemm
from .. import env
from ..mem_cache.huge_pages import huge_page_empty, transparent_huge_pages
from .quant_linear import QuantWeight

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
BATCH_HINT = 1   # oneDNN picks the blocked layout for this many rows; any row count still works


@dataclass
class GemmWeight:
    """A weight in kernels/cpu_gemm's layout: `data` is a view into the shared huge-page arena."""

    data: torch.Tensor
    out_features: int

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return self.data.element_size()


def onednn_supported(weight: torch.Tensor) -> bool:
    """oneDNN packs and multiplies this weight's dtype here (bf16: AVX512 CPUs, not AVX2 ones)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def packing_supported(weight: torch.Tensor) -> bool:
    """This CPU has a packed layout for this weight's dtype: oneDNN's, or for bf16 the gemm kernel's
    (on AVX2 CPUs the only one: oneDNN has no bf16 matmul there). Whether one fits this particular
    weight is linear_select.candidates' business (a weight none fits stays on F.linear)."""
    if onednn_supported(weight):
        return True
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and load_cpu_gemm() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | GemmWeight | QuantWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one. x: [n, in] -> [n, out]."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, QuantWeight):           # GGUF weights kept quantized (quant_linear.py)
        return packed.linear(x, bias)
    if isinstance(packed, GemmWeight):
        if x.stride(-1) != 1:
            x = x.contiguous()
        return load_cpu_gemm().linear(x, packed.data, packed.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_silu_mul(x: torch.Tensor, layer: nn.Module) -> torch.Tensor | None:
    """silu(gate) * up of a [gate; up] projection (x: [n, in] -> [n, out / 2]) in one pass over the gemm
    layout (kernels/cpu_gemm/gemm_silu.h: the same bits as the projection then SiluAndMul, without the
    [n, out] product), or None where that path does not apply (another layout, a bias, halves that
    are not whole 64-row blocks, a gathered output)."""
    packed = getattr(layer, "packed_weight", None)
    if (not isinstance(packed, GemmWeight) or getattr(layer, "bias", None) is not None or x.dim() != 2
            or packed.out_features % 128 or getattr(layer, "gather_output", False)):
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    return load_cpu_gemm().linear_silu_mul(x, packed.data, packed.out_features // 2)


def gemm_fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0
            and (bias is None or bias.dtype == torch.bfloat16))


def pack_linear_weights(model: nn.Module) -> int:
    """Packs the weight of every module with a `packed_weight` attribute (None until packed).

    Side effects: chooses each weight's kernel (linear_select.choose_kernels: may time the shapes and
    write its cache file), sets `module.linear_kernel` and `module.packed_weight`, and replaces the module's dense `weight` data with an
    empty tensor when nothing else holds it. Returns how many weights were packed (0 when packing is
    disabled or unsupported here); logs the count, the layout and the time taken.
    """
    if env.DISABLE_PACKED_WEIGHTS.get():
        logger.info("Packed weights off (RADIXLM_DISABLE_PACKED_WEIGHTS); linear layers use F.linear")
        return 0
    start = time.perf_counter()
    modules = [m for m in model.modules() if getattr(m, "packed_weight", 1) is None
               and getattr(m, "linear_kernel", None) is None and packing_supported(m.weight)]
    weight_users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            weight_users[id(p)] = weight_users.get(id(p), 0) + 1
    from .linear_select import choose_kernels

    kernels = choose_kernels(modules) if modules else {}
    if modules and env.CPU_LINEAR_KERNEL.get() == "auto" and load_cpu_gemm() is not None:
        for m in modules:   # MoE experts: kernels/cpu_moe runs them only from the gemm layout
            if getattr(m, "prefer_gemm", False) and gemm_fits(m.weight, getattr(m, "bias", None)):
                kernels[id(m)] = "gemm"
    for m in modules:
        m.linear_kernel = kernels[id(m)]       # marks the module as decided (packing twice is a no-op)
    in_gemm = {i for i, k in kernels.items() if k == "gemm"}
    modules = [m for m in modules if kernels[id(m)] != "torch"]
    gemm = load_cpu_gemm() if in_gemm else None
    arena = huge_page_empty(sum(gemm.packed_numel(*m.weight.shape) for m in modules if id(m) in in_gemm),
                            torch.bfloat16) if in_gemm else None
    offset = 0
    for module in modules:
        weight = module.weight.detach()
        if id(module) in in_gemm:
            data = arena[offset: offset + gemm.packed_numel(*weight.shape)]
            offset += data.numel()
            gemm.pack(weight.contiguous(), data)
            module.packed_weight = GemmWeight(data, weight.shape[0])
        else:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        if weight_users.get(id(module.weight), 0) <= 1:
            module.weight.data = weight.new_empty((0, weight.shape[1]))
    if modules or kernels:
        layout = (f"{len(in_gemm)} in the bf16 gemm layout ({offset * 2 / 2**20:.0f} MiB, "
                  f"transparent huge pages: {transparent_huge_pages()})" if in_gemm else "oneDNN layout")
        if in_gemm and len(in_gemm) < len(modules):
            layout += f", {len(modules) - len(in_gemm)} in oneDNN's"
        if len(kernels) > len(modules):
            layout += f"; {len(kernels) - len(modules)} left plain for F.linear"
        logger.info("Packed %d linear weights, %s, in %.1f s", len(modules), layout, time.perf_counter() - start)
    return len(modules)


def packed_weight_bytes(model: nn.Module) -> int:
    return sum(m.packed_weight.numel() * m.packed_weight.element_size()
               for m in model.modules() if getattr(m, "packed_weight", None) is not None)
