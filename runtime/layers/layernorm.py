"""RMSNorm computed in fp32 and cast back, with the weight applied in the input dtype (as HF does).

`forward(x)` returns the normed x; `forward(x, residual)` first adds (SGLang style): residual =
x + residual, x = norm(residual), returning (x, residual). On CPU the fused C++ ops
(kernels/cpu_ops) do both in one pass, in place, with the same rounding; `forward_native` is the
torch code, the fallback and the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import cpu_ops


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        if self.weight.is_cpu:     # build/load the fused ops while the model is built, not in the first forward
            cpu_ops.enabled()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: a new normed tensor (x unchanged). With it: (x, residual) after the add;
        the fused path writes both into the given tensors (in place)."""
        if x.dim() >= 2:
            if residual is None and cpu_ops.fits(x, self.weight):
                out = torch.empty_like(x)          # dense like x, or contiguous for a strided view
                cpu_ops.call("rms_norm", out, x, self.weight, self.eps)
                return out
            if residual is not None and residual.shape == x.shape and cpu_ops.fits(x, residual, self.weight):
                cpu_ops.call("fused_add_rms_norm", x, residual, self.weight, self.eps)
                return x, residual
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch code (new tensors, inputs unchanged)."""
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
