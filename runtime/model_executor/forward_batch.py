"""ForwardBatch: the flat tensors one forward pass needs.

Per request i (all lengths in tokens):

    [0, prefix_len)          KV already in the pool (radix hit, earlier chunk, or earlier decode)
    [prefix_len, seq_len)    this pass computes these tokens (extend_len = seq_len - prefix_len)

DECODE is the special case extend_len == 1 for every request. A batch that mixes decodes with
prefill chunks is an EXTEND: a decode is an extend of length one. The KV manager has already
written each request's slots for [prefix_len, seq_len) into its req_to_token row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from ..utils import to_device

if TYPE_CHECKING:
    from ..mem_cache.memory_pool import KVCache, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = 1
    DECODE = 2

    @property
    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor          # [num_tokens] int64
    positions: torch.Tensor          # [num_tokens] int64
    out_cache_loc: torch.Tensor      # [num_tokens] int64, KV slot written for each token
    req_pool_indices: torch.Tensor   # [bs] int64, row in req_to_token
    seq_lens: torch.Tensor           # [bs] int64, length after this pass
    prefix_lens: torch.Tensor        # [bs] int64
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    kv_cache: KVCache
    attn_backend: object = None      # the model runner's AttentionBackend
    attn_metadata: object = None     # set by the attention backend's init_forward_metadata
    # [m] int64 or None: the token rows whose final hidden states the caller reads (the model runner
    # sets them for a prefill / extend pass: each request's last row and any logprob rows). The model
    # then returns those rows only, in this order, and runs the last layer's o_proj and MLP on them
    # alone: nothing else reads the others (their K/V is written before). None: every row.
    output_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def extend_lens_cpu(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens_cpu, self.prefix_lens_cpu)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @staticmethod
    def build(mode: ForwardMode, input_ids: list[int], req_rows: list[int], prefix_lens: list[int],
              seq_lens: list[int], out_cache_loc: torch.Tensor, req_to_token_pool: ReqToTokenPool,
              kv_cache: KVCache, device: torch.device | str) -> ForwardBatch:
        """Builds the tensors. Reads nothing from the table and writes nothing anywhere.

        No Python loop over requests: a few list->tensor conversions and, for extends, one
        vectorized position computation (decode positions are the prefix lengths themselves).
        Each host tensor reaches the device once, through pinned memory on CUDA (`to_device`)."""
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int64)
        seq_t = torch.tensor(seq_lens, dtype=torch.int64)
        prefix_dev = to_device(prefix_t, device)
        if mode.is_decode:
            positions = prefix_dev                                # the one new token sits at prefix_len
        else:
            positions = to_device(extend_positions(prefix_t, seq_t), device)
        return ForwardBatch(
            forward_mode=mode,
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.int64), device),
            positions=positions,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),   # no copy: KVManager put it there
            req_pool_indices=to_device(torch.tensor(req_rows, dtype=torch.int64), device),
            seq_lens=to_device(seq_t, device),
            prefix_lens=prefix_dev,
            seq_lens_cpu=list(seq_lens),
            prefix_lens_cpu=list(prefix_lens),
            req_to_token_pool=req_to_token_pool,
            kv_cache=kv_cache,
        )


def extend_positions(prefix_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """concat(arange(prefix_lens[i], seq_lens[i]) for each i) as one int64 tensor, vectorized."""
    ext = seq_lens - prefix_lens
    total = int(ext.sum())
    starts = torch.cumsum(ext, 0) - ext                        # flat index of each request's first token
    return torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(prefix_lens - starts, ext)
