"""Mixture-of-experts models: Qwen2-MoE, Qwen3-MoE and Mixtral, as the Llama block with an MoE MLP.

Each is `LlamaForCausalLM` with `LlamaOptions.moe` set: the layers the config marks sparse get a
`SparseMoeBlock` (runtime/layers/moe.py) as their `mlp`, the others keep the dense `LlamaMLP`.

    Qwen2-MoE   q/k/v bias (qkv_bias); experts of moe_intermediate_size; a shared expert of
                shared_expert_intermediate_size gated by sigmoid(shared_expert_gate(x));
                top-k renormalized only if norm_topk_prob
    Qwen3-MoE   per-head q/k RMSNorm; experts of moe_intermediate_size; norm_topk_prob
    Mixtral     experts of intermediate_size, always renormalized; checkpoint names
                block_sparse_moe.* and experts.{e}.w1 / w3 / w2 (gate / up / down), renamed on load

The expert settings and which layers are sparse come from `ModelConfig.moe`
(config_fields.moe_options).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .llama import LlamaForCausalLM, LlamaOptions
from .model_config import ModelConfig


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, moe=config.moe)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                            moe=config.moe)


_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def options_for(cls, config: ModelConfig) -> LlamaOptions:
        return LlamaOptions(moe=config.moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Renames Mixtral's checkpoint pieces to the Qwen/Llama ones, then loads as Llama does."""
        def renamed():
            for name, tensor in weights:
                yield ".".join(_MIXTRAL_NAMES.get(part, part) for part in name.split(".")), tensor
        return super().load_weights(renamed())
