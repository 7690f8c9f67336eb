"""Tensor-parallel linear layers whose parameters shard the full checkpoint tensor while loading.

Weights follow nn.Linear: `weight [out_features, in_features]`. Every parameter carries
`param.weight_loader(param, loaded_weight, shard_id=None)`, which takes the *full* checkpoint
tensor and copies this rank's slice into `param`, so no rank keeps the whole model.

    ColumnParallelLinear        splits the output dim: rank r owns rows [r*out/tp, (r+1)*out/tp)
    RowParallelLinear           splits the input dim, all-reduces the partial outputs
    MergedColumnParallelLinear  several column-parallel outputs fused (gate_up: shard_id 0, 1)
    QKVParallelLinear           fused q, k, v (shard_id "q", "k", "v"); kv heads are sharded, or
                                replicated when tp > num_kv_heads (rank r uses kv head r*kv/tp)
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from .packed_linear import linear


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), refusing the silent broadcasting copy_ would otherwise allow."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copies a replicated tensor whole (norm weights, unsharded biases)."""
    copy_checked(param.data, loaded_weight)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


def _make_param(shape: tuple[int, ...], loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; returns this rank's slice unless `gather_output`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = _divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.weight = _make_param((self.output_size_per_rank, input_size), self.weight_loader)
        self.bias = _make_param((self.output_size_per_rank,), self.weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None   # set by pack_linear_weights after loading

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        rows = param.shape[0]
        copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed_weight, self.bias)
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul; each rank holds its slice of each part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes_per_rank = [_divide(s, self.tp_size, "output size") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            for i, size in enumerate(self.output_sizes):
                start = sum(self.output_sizes[:i])
                self.weight_loader(param, loaded_weight.narrow(0, start, size), i)
            return
        index = int(shard_id)
        rows = self.output_sizes_per_rank[index]
        offset = sum(self.output_sizes_per_rank[:index])
        copy_checked(param.data.narrow(0, offset, rows), loaded_weight.narrow(0, self.tp_rank * rows, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection. Output per rank: [q heads | kv heads | kv heads] * head_dim."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "tp size vs kv heads")  # each kv head on tp/kv ranks
            self.num_kv_heads, self.kv_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of kv heads")
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias=bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        # region table of this rank's rows: [0, q) q | [q, q+kv) k | [q+kv, q+2kv) v
        if shard_id == "q":
            offset, rows, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows = self.kv_size
            start = (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, rows), loaded_weight.narrow(0, start, rows))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the partial products are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = _divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = _make_param((output_size, self.input_size_per_rank), self.weight_loader)
        self.bias = _make_param((output_size,), default_weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None   # set by pack_linear_weights after loading

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        cols = param.shape[1]
        copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, input_size_per_rank] (this rank's slice of the input features)
        y = linear(x, self.weight, self.packed_weight)
        if self.reduce_results:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
