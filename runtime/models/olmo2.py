"""OLMo 2: the Llama decoder with norms after attention and MLP (no input norm) and an RMSNorm
over the whole q and k projections (not per head) before rope. Tensor parallel size 1 only (the
q/k norm spans every head)."""

from __future__ import annotations

from .llama import LlamaForCausalLM, LlamaOptions
from .model_config import ModelConfig


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                            qk_norm_full=True, post_norms=True)
