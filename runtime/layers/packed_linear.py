"""Linear layers on CPU with their weights prepacked for oneDNN, once, after loading.

`F.linear` on a plain row-major bf16 weight makes oneDNN reorder (or read with a poor stride) the
whole weight on every call. Reordering once into oneDNN's blocked layout and calling the packed
matmul reads each weight byte once per step instead: on this project's 2-core AVX512-BF16 box the
30 layers of SmolLM2-135M plus its LM head took 16 ms instead of 21-31 ms at batch 1 and 20-22 ms
instead of 32-37 ms at batch 16 (benchmarks/README.md). The results are bit-identical to F.linear
(the same oneDNN kernels compute them).

    pack_linear_weights(model)      # after load_weights: every layer with a `packed_weight` slot
    y = linear(x, layer.weight, layer.packed_weight, bias)

Only bf16/fp16 weights on CPU are packed (fp32 F.linear goes to MKL's sgemm, which is left alone).
Packing frees the dense weight unless another module shares it (a tied LM head keeps the embedding
table, and gets its own packed copy). `--disable-packed-weights` (or
`RADIXLM_DISABLE_PACKED_WEIGHTS=1`) keeps the plain path; `--enable-torch-compile` does too, since
inductor packs the weights of the graphs it compiles itself.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_build import env_flag

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
BATCH_HINT = 1   # oneDNN picks the blocked layout for this many rows; any row count still works


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one. x: [n, in] -> [n, out]."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Packs the weight of every module with a `packed_weight` attribute (None until packed).

    Side effects: sets `module.packed_weight`, and replaces the module's dense `weight` data with an
    empty tensor when nothing else holds it. Returns how many weights were packed (0 when packing is
    disabled or unsupported here); logs the count and the time taken.
    """
    if env_flag("RADIXLM_DISABLE_PACKED_WEIGHTS"):
        logger.info("Packed weights off (RADIXLM_DISABLE_PACKED_WEIGHTS); linear layers use F.linear")
        return 0
    start = time.perf_counter()
    modules = [m for m in model.modules() if hasattr(m, "packed_weight") and m.packed_weight is None]
    weight_users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            weight_users[id(p)] = weight_users.get(id(p), 0) + 1
    count = 0
    for module in modules:
        weight = module.weight
        if not packing_supported(weight):
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        if weight_users.get(id(weight), 0) <= 1:
            module.weight.data = weight.new_empty((0, weight.shape[1]))
        count += 1
    if count:
        logger.info("Packed %d linear weights for oneDNN in %.1f s", count, time.perf_counter() - start)
    return count


def packed_weight_bytes(model: nn.Module) -> int:
    return sum(m.packed_weight.numel() * m.packed_weight.element_size()
               for m in model.modules() if getattr(m, "packed_weight", None) is not None)
