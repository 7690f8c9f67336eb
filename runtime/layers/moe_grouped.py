"""Experts as two grouped matmuls (`torch._grouped_mm`): the MoE path on CUDA.

    pairs sorted by expert:  xs = x[token_of]                       [n*k, H]
    offs = cumsum(bincount(expert ids))  (on the device)            [E] int32, end row of each expert
    h  = grouped_mm(xs, gate_up[e]^T)  over each expert's rows     [n*k, 2I]
    y  = grouped_mm(silu(h_gate) * h_up, down[e]^T)                [n*k, H]
    out.index_add_(token_of, y * routing weight)

Nothing is read back to the host (the torch loop in moe.py reads the per-expert counts), so a MoE
layer can be captured in a CUDA graph. The experts' weights are stacked once into [E, 2I, H] and
[E, H, I] tensors and each expert's own weight becomes a view of its slice (no second copy), so the
torch loop and this path read the same memory. torch's grouped matmul runs bf16 on CUDA compute
capability 9.0 (Hopper) and later; elsewhere `grouped_mm_supported` is False and the loop runs. On
CPU torch has it too (a loop inside torch): tests compare the two paths there.
"""

from __future__ import annotations

import torch
from torch import nn

from .activation import SiluAndMul


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs these experts on `device`: bf16 on CUDA sm90+."""
    if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
        return False
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def stack_expert_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, 2I, H] gate_up, [E, H, I] down); afterwards each expert's weights are views of them."""
    gate_up = torch.stack([e.gate_up_proj.weight.data for e in experts])
    down = torch.stack([e.down_proj.weight.data for e in experts])
    for i, e in enumerate(experts):
        e.gate_up_proj.weight.data = gate_up[i]
        e.down_proj.weight.data = down[i]
    return gate_up, down


_act = SiluAndMul()


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert[ids[t, j]](x[t]) for every token t: x [n, H], ids / weights
    [n, k] (weights fp32), gate_up [E, 2I, H], down [E, H, I] -> [n, H] in x's dtype."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    h = torch._grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(_act(h), down.transpose(1, 2), offs=offs)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, (y.float() * weights.flatten()[order, None]).to(x.dtype))
    return out
