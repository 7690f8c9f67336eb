"""Mixture-of-experts MLP: a router picks top-k experts per token; experts run as grouped matmuls.

    logits = router(x)                       # [n, E]
    p = softmax(logits, fp32); w, ids = topk(p, k); w /= sum(w) if renormalize
    y[t] = sum_j w[t, j] * expert[ids[t, j]](x[t])       (+ sigmoid(shared_gate(x)) * shared(x))

Grouped execution: the n*k (token, expert) pairs are sorted by expert; each expert that got tokens
runs once, as one matmul over the rows routed to it (its gate_up, SiLU*mul, down), and its rows are
scaled by their routing weights and scatter-added back (`index_add_`). The loop is over experts that
got tokens, never over tokens. Each expert is a `LlamaMLP`-shaped pair of parallel linear layers, so
`pack_linear_weights` packs expert weights like the dense ones and TP splits every expert's
intermediate size; the down projections skip their all-reduce and the summed output is reduced once.
The loop reads the per-expert counts on the host. On CUDA the experts run as two grouped matmuls
instead (moe_grouped.py: the counts stay on the device, so decode can be captured in CUDA graphs)
where torch has them (bf16, sm90+); elsewhere on CUDA the loop runs and graphs are off.

On CPU, when every expert's weights were packed in kernels/cpu_gemm's layout (bf16; AVX512 or AVX2),
the router runs as a packed gemm too and the experts run in one call of kernels/cpu_moe (grouping,
gate_up, SiLU*mul, down and the weighted sum in fp32, experts x output blocks spread over the
threads); softmax/top-k and the shared expert stay here. The one-call CPU decoder
(kernels/cpu_decoder) runs that same fused path in C++ at decode. `forward_native` is the torch
loop: the fallback and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ...kernels.cpu_gemm import load_cpu_gemm
from ...kernels.cpu_moe import load_cpu_moe
from ..distributed.parallel_state import get_tp_size, tp_all_reduce
from .activation import SiluAndMul
from .linear import MergedColumnParallelLinear, RowParallelLinear, default_weight_loader
from .moe_grouped import grouped_experts, grouped_mm_supported, stack_expert_weights
from .packed_linear import GemmWeight, linear_silu_mul


@dataclass(frozen=True)
class MoEOptions:
    """What a model's config says about its experts (see runtime/models/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int            # per expert
    renormalize: bool                 # divide the top-k weights by their sum
    shared_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    sparse_layers: tuple[int, ...] = ()


class ExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `reduce_results=False` leaves the TP all-reduce to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results)
        self.act_fn = SiluAndMul()
        # packed in the gemm layout whatever linear_select measured: kernels/cpu_moe needs it
        self.gate_up_proj.prefer_gemm = self.down_proj.prefer_gemm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear_silu_mul(x, self.gate_up_proj)       # one pass over the gemm layout where it applies,
        return self.down_proj(self.act_fn(self.gate_up_proj(x)) if h is None else h)   # as the decoder does


def _replicated(in_features: int, out_features: int) -> nn.Linear:
    """A small weight every rank holds whole (the router, the shared-expert gate)."""
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.weight.requires_grad_(False)
    layer.weight.weight_loader = default_weight_loader
    return layer


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] fp32, expert ids [n, k]): softmax in fp32, top-k, optionally renormalized."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(NamedTuple):
    """What SparseMoeBlock's fused path (and the one-call CPU decoder) runs on."""

    mod: object                   # kernels/cpu_moe
    gate_up: torch.Tensor         # int64 [E]: data pointers of each expert's packed gate_up
    down: torch.Tensor            # int64 [E]: ... and down
    inter: int                    # expert intermediate size
    packed: list                  # [(gate_up, down) GemmWeight]: what the pointers point into
    gemm: object                  # kernels/cpu_gemm
    router: torch.Tensor          # the router weight in the gemm layout (64 experts x 1024: ~2 us
                                  # at batch 1, where F.linear's oneDNN call took ~15 us)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer. Checkpoint names: `gate` (router), `experts.{e}.gate_proj /
    up_proj / down_proj`, and for Qwen2-MoE `shared_expert.*` and `shared_expert_gate`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = _replicated(hidden_size, num_experts)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size, reduce_results=False)
                                     for _ in range(num_experts))
        self.shared_expert = (ExpertMLP(hidden_size, shared_intermediate_size, reduce_results=False)
                              if shared_intermediate_size else None)
        self.shared_expert_gate = _replicated(hidden_size, 1) if shared_intermediate_size else None
        self._fused: FusedExperts | tuple | None = None   # () once found unusable
        self._stacked: tuple | None = None  # CUDA: (gate_up [E, 2I, H], down [E, H, I]); () for the loop

    def fused_tables(self) -> FusedExperts | None:
        """kernels/cpu_moe, its per-expert pointer tables and the packed router when every expert's
        gate_up and down are in the gemm layout, else None. Decided once, after packing
        (pack_linear_weights) has run."""
        if self._fused is not None:
            return self._fused or None
        layers = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        if getattr(layers[0][0], "linear_kernel", None) is None:
            return None                       # not packed (yet): ask again next call
        packed = [(gu.packed_weight, down.packed_weight) for gu, down in layers]
        mod = load_cpu_moe() if all(isinstance(g, GemmWeight) and isinstance(d, GemmWeight)
                                    for g, d in packed) else None
        inter = packed[0][0].out_features // 2 if mod is not None else 0
        if mod is None or any(g.out_features != 2 * inter or d.out_features != self.gate.in_features for g, d in packed):
            self._fused = ()
            return None
        gate_up = torch.tensor([g.data.data_ptr() for g, _ in packed], dtype=torch.int64)
        down = torch.tensor([d.data.data_ptr() for _, d in packed], dtype=torch.int64)
        gemm = load_cpu_gemm()
        router = torch.empty(gemm.packed_numel(*self.gate.weight.shape), dtype=torch.bfloat16)
        gemm.pack(self.gate.weight.detach().contiguous(), router)
        self._fused = FusedExperts(mod, gate_up, down, inter, packed, gemm, router)
        return self._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, hidden]
        if x.is_cuda:
            return self.forward_cuda(x)
        fused = self.fused_tables() if x.is_cpu and x.dtype == torch.bfloat16 and x.shape[0] > 0 else None
        if fused is None:
            return self.forward_native(x)
        x = x.contiguous()
        logits = fused.gemm.linear(x, fused.router, self.num_experts, None)   # the router, in the gemm layout
        weights, ids = route(logits, self.top_k, self.renormalize)
        out = fused.mod.experts_forward(x, ids.contiguous(), weights.contiguous(), fused.gate_up, fused.down,
                                        fused.inter)
        return self._add_shared_and_reduce(x, out)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The experts as two grouped matmuls (moe_grouped.py: no host sync, so CUDA graphs can
        capture it) where torch has them for this GPU and dtype, else the torch loop."""
        if self._stacked is None:
            self._stacked = stack_expert_weights(self.experts) if grouped_mm_supported(x.device, x.dtype) else ()
        if not self._stacked:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("MoE layers without grouped matmuls (bf16 on sm90+) read per-expert "
                                   "token counts on the host and cannot be captured in a CUDA graph")
            return self.forward_native(x)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self._add_shared_and_reduce(x, grouped_experts(x, ids, weights, *self._stacked))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch loop over experts that got tokens (the module docstring)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        flat_ids = ids.flatten()                                       # [n*k], pair p is token p // k
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // self.top_k                                 # [n*k] token of each sorted pair
        pair_weight = weights.flatten()[order]
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            # region: sorted pairs [start, start + count) are the rows routed to expert e
            rows = token_of[start:start + count]
            y = self.experts[e](x[rows])
            out.index_add_(0, rows, (y.float() * pair_weight[start:start + count, None]).to(x.dtype))
            start += count
        return self._add_shared_and_reduce(x, out)

    def _add_shared_and_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x).float())
            out += (self.shared_expert(x).float() * gate).to(x.dtype)
        return tp_all_reduce(out) if get_tp_size() > 1 else out
