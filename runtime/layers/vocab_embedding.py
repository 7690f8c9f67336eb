"""Vocab-sharded token embedding and LM head.

The vocab is padded up to a multiple of the TP size; rank r owns rows
[r*rows_per_rank, (r+1)*rows_per_rank) of the padded table, and rows past `vocab_size` stay zero.

    embedding: each rank looks up the ids it owns (others read as 0), then the ranks all-reduce
    lm head:   each rank scores its rows, the ranks all-gather them, the padding is dropped
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from ..utils import ceil_div
from .packed_linear import linear
from .quant_linear import QuantWeight


class VocabParallelEmbedding(nn.Module):
    """`forward(input_ids [n]) -> [n, hidden]`; weight `[rows_per_rank, hidden]` on each rank."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = ceil_div(vocab_size, self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        # rows of the real vocab on this rank (the last rank may hold padding)
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant_weight: QuantWeight | None = None   # a GGUF table kept quantized (models/gguf_quant.py)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.vocab_size or loaded_weight.shape[1] != param.shape[1]:
            raise ValueError(f"shape mismatch: vocab table ({self.vocab_size}, {param.shape[1]}), "
                             f"checkpoint {tuple(loaded_weight.shape)}")
        param.data.zero_()
        param.data[: self.num_real_rows].copy_(loaded_weight.narrow(0, self.vocab_start, self.num_real_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:             # one rank only: rows dequantized on lookup
            return self.quant_weight.rows(input_ids, self.weight.dtype)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_real_rows)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection. With `tied_to`, it shares that embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabParallelEmbedding | None = None):
        if tied_to is None:
            super().__init__(vocab_size, hidden_size)
            self.packed_weight: torch.Tensor | None = None   # set by pack_linear_weights
            return
        nn.Module.__init__(self)
        self.tp_rank, self.tp_size = tied_to.tp_rank, tied_to.tp_size
        self.vocab_size, self.rows_per_rank = tied_to.vocab_size, tied_to.rows_per_rank
        self.vocab_start, self.num_real_rows = tied_to.vocab_start, tied_to.num_real_rows
        self.weight = tied_to.weight
        self.packed_weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits [n, vocab_size] in float32, gathered over all ranks."""
        logits = linear(hidden, self.weight, self.packed_weight)   # [n, rows_per_rank]
        logits = tp_all_gather(logits, dim=-1)           # [n, rows_per_rank * tp]
        return logits[:, : self.vocab_size].float()
