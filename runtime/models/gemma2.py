"""Gemma 2: Gemma 3's decoder (gemma3.py) without the q/k norm, with attention soft-capping.

Attention scores are soft-capped, s -> cap * tanh(s / cap) with cap = attn_logit_softcapping
(RadixAttention's logit_cap, taken by every attention path), logits by final_logit_softcapping;
the even layers attend over a sliding window (layer_types), all layers share one rope base.
"""

from __future__ import annotations

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaOptions
from .model_config import ModelConfig


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=False,
                            sandwich_norms=True, embed_scale=True)
