"""The attention-backend interface and the `RadixAttention` layer that models call.

A model's attention module computes q, k, v for the batch's new tokens and calls
`RadixAttention.forward(q, k, v, forward_batch)`. The layer writes k and v into the paged KV
cache at `forward_batch.out_cache_loc`, then the backend attends each request's new queries over
its whole KV (`req_to_token[row, :seq_len]`), causally within the new tokens; a layer with a
`sliding_window_size` sees only the keys of that window. The full KV stays in the cache either way.
A layer with `logit_cap` > 0 (Gemma 2) soft-caps its scores: s -> logit_cap * tanh(s / logit_cap).

Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
output [num_tokens, num_heads, head_dim]. Heads here are this TP rank's heads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from ...model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One instance per model runner; `init_forward_metadata` runs once per forward pass,
    before any layer, and may store what it computes on `forward_batch.attn_metadata`."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                fb: ForwardBatch) -> torch.Tensor:
        """Writes this pass's k/v into the cache, then attends. Returns [num_tokens, heads, head_dim]."""
        fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode:
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)


class RadixAttention(nn.Module):
    """Attention over the paged KV cache; holds no weights."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window_size: int = -1, logit_cap: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        # >= 0: the query at position i sees only keys [i - sliding_window_size, i] (FlashInfer's
        # window_left, SGLang's name; HF's sliding_window is this + 1); -1: full causal attention
        self.sliding_window_size = sliding_window_size
        self.logit_cap = logit_cap          # > 0: scores soft-capped (SGLang's name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = fb.attn_backend.forward(q, k, v, self, fb)
        return out.reshape(-1, self.num_heads * self.head_dim)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    def deco(cls):
        ATTENTION_BACKENDS[name] = cls
        return cls

    return deco


def create_backend(name: str, **kwargs) -> AttentionBackend:
    """Backends register on import; flashinfer is imported only when asked for (CUDA only)."""
    if name == "torch_native":
        from . import torch_native  # noqa: F401
    elif name == "flashinfer":
        from . import flashinfer_backend  # noqa: F401
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; choose from torch_native, flashinfer")
    return ATTENTION_BACKENDS[name](**kwargs)
