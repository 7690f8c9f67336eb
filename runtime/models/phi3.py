"""Phi-3: the Llama decoder with fused `qkv_proj` and `gate_up_proj` tensors in the checkpoint.

The fused checkpoint tensors are split on load into the q/k/v and gate/up shards the parallel
layers take (rows [q | k | v] and [gate | up]), so TP slicing works as for Llama. Phi-3's
`sliding_window` (every layer, as transformers applies it) comes from ModelConfig. LongRoPE
(`rope_type` "longrope"/"su": short or long factors chosen once per server from --context-length,
see layers/rotary.py `longrope_parameters`) and `partial_rotary_factor` < 1 (Phi-4-mini: rope on
the first rotary_dim lanes of each head) are ModelConfig.rope_scaling / rotary_dim, applied by the
shared RotaryEmbedding (the fused CPU op and the one-call decoder take the partial width too).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        c = self.config
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def split():
            for name, tensor in weights:
                if name.endswith("self_attn.qkv_proj.weight"):
                    for piece, part in zip(("q_proj", "k_proj", "v_proj"),
                                           tensor.split([q_rows, kv_rows, kv_rows], dim=0), strict=True):
                        yield name.replace("qkv_proj", piece), part
                elif name.endswith("mlp.gate_up_proj.weight"):
                    gate, up = tensor.chunk(2, dim=0)
                    yield name.replace("gate_up_proj", "gate_proj"), gate
                    yield name.replace("gate_up_proj", "up_proj"), up
                else:
                    yield name, tensor
        return super().load_weights(split())
