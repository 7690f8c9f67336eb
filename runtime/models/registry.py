"""Maps HF `architectures` names to model classes (imported on first use, so this module is cheap)."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module, class); Mistral checkpoints use the Llama layout and names.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("radixlm.runtime.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("radixlm.runtime.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("radixlm.runtime.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("radixlm.runtime.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("radixlm.runtime.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("radixlm.runtime.models.moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("radixlm.runtime.models.moe", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("radixlm.runtime.models.phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("radixlm.runtime.models.olmo2", "Olmo2ForCausalLM"),
    "Gemma2ForCausalLM": ("radixlm.runtime.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("radixlm.runtime.models.gemma3", "Gemma3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an HF architecture name; ValueError naming the supported ones otherwise."""
    if architecture not in _MODELS:
        raise ValueError(f"Unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
