"""ForwardBatch: the flat tensors one forward pass needs.

Per request i (all lengths in tokens):

    [0, prefix_len)          KV already in the pool (radix hit, earlier chunk, or earlier decode)
    [prefix_len, seq_len)    this pass computes these tokens (extend_len = seq_len - prefix_len)

DECODE is the special case extend_len == 1 for every request. MIXED (chunked prefill alongside
decodes) runs through the extend path: a decode is an extend of length one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3

    @property
    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    @property
    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


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
    # Logprob requests: per request, the first extend position whose input logprob is wanted
    # (relative to prefix_len), or None for none. Only meaningful for extend passes.
    logprob_start_lens: list[int | None] = field(default_factory=list)
    attn_backend: object = None      # the model runner's AttentionBackend
    attn_metadata: object = None     # set by the attention backend's init_forward_metadata

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
              kv_cache: KVCache, device: torch.device | str,
              logprob_start_lens: list[int | None] | None = None) -> ForwardBatch:
        """Builds the tensors and writes `out_cache_loc` into each request's table row."""
        positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)])
        out_cache_loc = out_cache_loc.to(torch.int64)
        table = req_to_token_pool.req_to_token
        offset = 0
        for row, p, s in zip(req_rows, prefix_lens, seq_lens):
            table[row, p:s] = out_cache_loc[offset: offset + s - p].to(table.dtype)
            offset += s - p
        return ForwardBatch(
            forward_mode=mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=torch.tensor(req_rows, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=device),
            seq_lens_cpu=list(seq_lens),
            prefix_lens_cpu=list(prefix_lens),
            req_to_token_pool=req_to_token_pool,
            kv_cache=kv_cache,
            logprob_start_lens=list(logprob_start_lens) if logprob_start_lens else [None] * len(seq_lens),
        )
