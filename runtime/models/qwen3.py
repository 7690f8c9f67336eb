"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rope (`q_norm`, `k_norm`)."""

from __future__ import annotations

from .llama import LlamaForCausalLM, LlamaOptions
from .model_config import ModelConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)
