"""Qwen2: the Llama decoder with biases on the q, k and v projections (none on o_proj or the MLP)."""

from __future__ import annotations

from .llama import LlamaForCausalLM, LlamaOptions
from .model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=True)
