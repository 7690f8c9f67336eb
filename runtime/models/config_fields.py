"""Which config.json fields radixlm implements, which it may ignore, and the load-time refusal.

Every field of the transformers config class of a registered architecture is in exactly one of:

    READ_FIELDS    radixlm reads it and the computation follows it (value: where it is read)
    INERT_FIELDS   it does not change a served forward pass (value: why)

(tests/unit/test_config_fields.py walks the config classes and checks this, and that changing
each READ field in config.json changes the loaded ModelConfig or is refused.)

`unsupported_reason(arch, hf)` runs at load (ModelConfig.from_path raises ModelLoadError with it)
and names a value radixlm cannot honor: an activation other than SiLU, a quantized checkpoint, an
encoder-decoder config, a layer type other than full or sliding attention. Keys that are no field of the architecture's config class
are ignored by transformers too, and so here.
"""

from __future__ import annotations

from ..layers.moe import MoEOptions

READ_FIELDS: dict[str, str] = {
    "architectures": "registry: picks the model class",
    "hidden_size": "ModelConfig.hidden_size",
    "intermediate_size": "ModelConfig.intermediate_size",
    "num_attention_heads": "ModelConfig.num_heads",
    "num_key_value_heads": "ModelConfig.num_kv_heads",
    "head_dim": "ModelConfig.head_dim",
    "num_hidden_layers": "ModelConfig.num_layers",
    "vocab_size": "ModelConfig.vocab_size",
    "rms_norm_eps": "ModelConfig.rms_norm_eps",
    "max_position_embeddings": "ModelConfig.max_position_embeddings (rope cache, context limit)",
    "dtype": "ModelConfig.dtype for --dtype auto",
    "torch_dtype": "ModelConfig.dtype for --dtype auto (transformers 4 name)",
    "eos_token_id": "ModelConfig.eos_token_ids",
    "tie_word_embeddings": "ModelConfig.tie_word_embeddings",
    "rope_parameters": "ModelConfig.rope_theta / rope_scaling (rope types checked)",
    "rope_theta": "ModelConfig.rope_theta (transformers 4 name)",
    "rope_scaling": "ModelConfig.rope_scaling (transformers 4 name)",
    "attention_bias": "ModelConfig.attention_bias",
    "mlp_bias": "ModelConfig.mlp_bias",
    "hidden_act": "ModelConfig.hidden_act (silu or gelu_pytorch_tanh)",
    "hidden_activation": "ModelConfig.hidden_act (Gemma's name)",
    "query_pre_attn_scalar": "ModelConfig.query_pre_attn_scalar (the attention scale)",
    "final_logit_softcapping": "ModelConfig.final_logit_softcapping",
    "attn_logit_softcapping": "ModelConfig.attn_logit_softcapping (RadixAttention.logit_cap)",
    "use_bidirectional_attention": "refused here when true",
    "_sliding_window_pattern": "ModelConfig.sliding_window_layers when layer_types is absent (Gemma 3)",
    "sliding_window_pattern": "ModelConfig.sliding_window_layers (transformers 4 name)",
    "rope_local_base_freq": "ModelConfig.local_rope_theta (transformers 4 name)",
    "sliding_window": "ModelConfig.sliding_window (sliding_layers below)",
    "use_sliding_window": "ModelConfig.sliding_window_layers (Qwen: the window's switch)",
    "max_window_layers": "ModelConfig.sliding_window_layers (Qwen: the first sliding layer)",
    "layer_types": "ModelConfig.sliding_window_layers (sliding_attention / full_attention)",
    "qkv_bias": "ModelConfig.attention_bias (Qwen2-MoE's name)",
    "num_experts": "ModelConfig.moe.num_experts",
    "num_local_experts": "ModelConfig.moe.num_experts",
    "num_experts_per_tok": "ModelConfig.moe.top_k",
    "moe_intermediate_size": "ModelConfig.moe.intermediate_size",
    "norm_topk_prob": "ModelConfig.moe.renormalize",
    "shared_expert_intermediate_size": "ModelConfig.moe.shared_intermediate_size",
    "decoder_sparse_step": "ModelConfig.moe.sparse_layers",
    "mlp_only_layers": "ModelConfig.moe.sparse_layers",
    "original_max_position_embeddings": "ModelConfig.rope_scaling (LongRoPE: factor choice and attention factor; "
                                        "no effect with other rope types, as in transformers)",
}

INERT_FIELDS: dict[str, str] = {
    "_name_or_path": "where transformers loaded it from",
    "transformers_version": "the writer's version",
    "model_type": "architectures picks the class",
    "bos_token_id": "the tokenizer and chat template add BOS; the model does not read it",
    "pad_token_id": "requests are packed, never padded",
    "initializer_range": "random init only; weights come from the checkpoint",
    "attention_dropout": "dropout is off at inference",
    "pretraining_tp": "transformers 5 no longer reads it; the math is the same",
    "use_cache": "HF's own KV cache switch; radixlm always uses its paged cache",
    "output_attentions": "HF output option",
    "output_hidden_states": "HF output option",
    "return_dict": "HF output option",
    "chunk_size_feed_forward": "HF memory chunking of the MLP; same values",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "is_encoder_decoder": "checked here to be false (decoder-only models)",
    "output_router_logits": "HF output option (router logits for the training loss)",
    "router_aux_loss_coef": "training loss weight",
    "router_jitter_noise": "HF applies the jitter only in training",
    "resid_pdrop": "dropout is off at inference",
    "embd_pdrop": "dropout is off at inference",
}

# architectures whose transformers code rotates only the first partial_rotary_factor of each head
PARTIAL_ROTARY_ARCHS = ("Phi3ForCausalLM",)

# fields of no registered config class that change the computation wherever transformers honors them
_REFUSED_IF_SET: dict[str, str] = {
    "quantization_config": "quantized safetensors checkpoints are not supported (use the unquantized "
                           "checkpoint, or a GGUF file)",
}


def unsupported_reason(arch: str, hf: dict) -> str | None:
    """Why radixlm cannot serve this config.json as transformers would, or None."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        return f"Unsupported hidden_act {act!r}; supported: silu, gelu_pytorch_tanh"
    if hf.get("use_bidirectional_attention"):
        return "use_bidirectional_attention (non-causal attention) is not supported"
    if hf.get("is_encoder_decoder"):
        return "Encoder-decoder models are not supported (is_encoder_decoder is true)"
    for key, why in _REFUSED_IF_SET.items():
        if hf.get(key):
            return f"config.json sets {key!r}: {why}"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and arch not in PARTIAL_ROTARY_ARCHS:
        return (f"partial_rotary_factor {partial} (rope on part of each head): transformers applies it for "
                f"{', '.join(PARTIAL_ROTARY_ARCHS)} only; not implemented for {arch}")
    unknown = sorted(set(hf.get("layer_types") or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        return f"Unsupported layer_types {unknown}; only full_attention and sliding_attention are supported"
    window = hf.get("sliding_window")
    if sliding_layers(arch, hf) and (not isinstance(window, int) or window < 1):
        return f"sliding_window must be a positive integer, got {window!r}"
    return None


def sliding_layers(arch: str, hf: dict) -> list[int]:
    """The layers that attend over a sliding window, decided as transformers decides it:
    Mistral, Mixtral, Phi-3: every layer when sliding_window is set. Qwen2/Qwen3 (and their MoE): none
    unless use_sliding_window; then `layer_types` when given, else layers >= max_window_layers
    (default 28); Qwen3-MoE every layer; Qwen2-MoE the even layers below max_window_layers.
    Gemma 3: `layer_types`, else every layer but each sliding_window_pattern-th; Gemma 2 the same
    with a pattern of 2 (even layers slide).
    Llama: none (LlamaConfig has no window)."""
    window = hf.get("sliding_window")
    num_layers = int(hf.get("num_hidden_layers", 0))
    if window is None or arch == "LlamaForCausalLM":
        return []
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return list(range(num_layers))
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):   # every Nth layer global, the rest sliding
        if hf.get("layer_types") is not None:
            return [i for i, t in enumerate(hf["layer_types"]) if t == "sliding_attention"]
        default = 2 if arch == "Gemma2ForCausalLM" else 6
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", default)))
        return [i for i in range(num_layers) if (i + 1) % pattern != 0]
    if not hf.get("use_sliding_window", False):
        return []
    if arch == "Qwen3MoeForCausalLM":               # no layer_types: the window is on every layer
        return list(range(num_layers))
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if arch == "Qwen2MoeForCausalLM":               # transformers' rule: even layers below max_window_layers
        return [i for i in range(num_layers) if i % 2 == 0 and i < int(hf.get("max_window_layers", 28))]
    return list(range(int(hf.get("max_window_layers", 28)), num_layers))


def moe_options(arch: str, hf: dict) -> MoEOptions | None:
    """The experts of a Qwen2-MoE, Qwen3-MoE or Mixtral config; None for dense architectures.
    Qwen: layer i is sparse unless in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0;
    top-k weights renormalized only with norm_topk_prob. Mixtral: every layer, always renormalized."""
    num_layers = int(hf["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoEOptions(num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 8))),
                          top_k=int(hf.get("num_experts_per_tok", 2)), intermediate_size=int(hf["intermediate_size"]),
                          renormalize=True, sparse_layers=tuple(range(num_layers)))
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    shared = int(hf.get("shared_expert_intermediate_size", 0) or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEOptions(num_experts=int(hf.get("num_experts", hf.get("num_local_experts"))),
                      top_k=int(hf["num_experts_per_tok"]), intermediate_size=int(hf["moe_intermediate_size"]),
                      renormalize=bool(hf.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                      sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))
