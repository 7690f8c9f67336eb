"""Gated activations for fused gate_up projections.

On CPU the fused C++ op (kernels/cpu_ops) computes silu(gate) * up in one pass with the eager
code's rounding; `forward_native` is the torch code, the fallback and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import cpu_ops


class SiluAndMul(nn.Module):
    """x: [..., 2*d] laid out [gate | up]; returns silu(gate) * up, shape [..., d] (a new tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[-1] % 2 == 0 and cpu_ops.fits(x):
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            cpu_ops.call("silu_and_mul", out, x)
            return out
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
