"""Gemma 3 (text): the Llama decoder with Gemma's options.

Embeddings scaled by sqrt(hidden_size); sandwich norms (input and post norms around both attention
and MLP); per-head q/k RMSNorm; GeGLU (gelu, tanh approximation); attention scale
query_pre_attn_scalar ** -0.5; every sliding_window_pattern-th layer global, the others sliding
with their own rope base (ModelConfig.local_rope_theta); tied embeddings. Gemma's RMSNorm scales by
(1 + w): the checkpoint's norm weights get 1 added at load, so `forward` runs the plain RMSNorm.
A final logit soft-cap is applied, and attention-score soft-capping when the config sets one
(Gemma 2, runtime/models/gemma2.py: RadixAttention's logit_cap).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .llama import LlamaForCausalLM, LlamaOptions
from .model_config import ModelConfig


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                            sandwich_norms=True, embed_scale=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Adds Gemma's +1 to every RMSNorm weight (computed in fp32, as Gemma's norm does)."""
        def plus_one():
            for name, tensor in weights:
                if name.endswith("norm.weight"):
                    tensor = (tensor.float() + 1.0).to(tensor.dtype)
                yield name, tensor
        return super().load_weights(plus_one())
