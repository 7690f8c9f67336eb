"""A GGUF file's metadata as an HF config.json dict, per architecture, refusing what radixlm does not implement.

llama.cpp stores the hyperparameters under `<arch>.<key>` (llama.cpp's names; transformers'
integrations/ggml.py maps the same keys). `gguf_hf_config(reader)` turns them into the config of the
registered radixlm architecture:

    general.architecture   radixlm architecture      specifics
    llama                  LlamaForCausalLM          q/k rows permuted (undone in gguf_loader.py); a
                                                     rope_freqs tensor (Llama 3.1 scaling as llama.cpp
                                                     stores it) becomes rope_type "freq_factors"
    llama with experts     MixtralForCausalLM        ffn_*_exps on every layer (llama.cpp's Mixtral)
    qwen2                  Qwen2ForCausalLM          q/k/v biases
    qwen3                  Qwen3ForCausalLM          q/k norms; head_dim from attention.key_length
    qwen2moe               Qwen2MoeForCausalLM       experts, gated shared expert; top-k weights not renormalized
    qwen3moe               Qwen3MoeForCausalLM       experts; top-k weights renormalized (llama.cpp's rule)
    phi3                   Phi3ForCausalLM           fused qkv / gate_up tensors; sliding window if stated;
                                                     LongRoPE from rope_factors_long / rope_factors_short
                                                     (+ rope.scaling.original_context_length, attn_factor);
                                                     rope.dimension_count < head_dim: partial rotary
    gemma2                 Gemma2ForCausalLM         attention / final logit soft-caps from the file; even
                                                     layers sliding (llama.cpp's rule), attention scale
                                                     as for gemma3
    gemma3                 Gemma3ForCausalLM         what the file does not state is llama.cpp's fixed rule:
                                                     every 6th layer global, the others sliding with rope
                                                     base 10000 (rope.freq_base_swa where stated);
                                                     attention scale head_dim ** -0.5 (hidden/heads for
                                                     the 62-layer 27B)
    olmo2                  Olmo2ForCausalLM          post-attention / post-MLP norms (post_attention_norm,
                                                     post_ffw_norm; no input norms), q/k norms over the
                                                     whole projection; NEOX rope, so q/k not permuted;
                                                     OLMo 3's sliding-window files refused

Every `<arch>.*` key is either read (`_READ`), known not to change the forward pass (`_INERT`), or
refused with ModelLoadError naming it (a rope scaling type other than linear, an attention head
size for values different from keys, a partial rotary dimension outside phi3 files, a sliding-window
layer pattern array, ...), as config_fields.py refuses config.json fields. So are tensors radixlm
would have to skip that change the computation (LongRoPE factors outside phi3 files). Dense-vs-sparse layers, q/k/v biases,
tied embeddings and the expert sizes come from which tensors the file holds when it says nothing.
Besides the file's eos id, the control tokens that end a turn (<|im_end|>, <end_of_turn>, ...) stop
generation, as in llama.cpp and the models' HF generation configs (not for llama files).
"""

from __future__ import annotations

from .model_config import ModelLoadError

# general.architecture -> (radixlm / HF architectures entry, HF model_type)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
}
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")

# <arch>.<key> -> HF config field
_READ = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
    "attention.sliding_window": "sliding_window",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}
# read below, with a check: rope.freq_base, rope.scaling.*, rope.dimension_count, attention.value_length
_CHECKED = ("rope.freq_base", "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor", "rope.dimension_count",
            "attention.value_length", "rope.scaling.attn_factor", "rope.scaling.original_context_length")
_INERT = {
    "rope.scaling.finetuned": "a training note",
    "attention.causal": "checked to be true (or absent) below",
    "expert_gating_func": "checked to be softmax (or absent) below",
}
# tensors that are rope parameters, not weights (the loader skips them)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LONGROPE_ARCHS = ("phi3",)        # llama.cpp writes rope_factors_{long,short} for Phi-3 (LongRoPE)
_PARTIAL_ROTARY_ARCHS = ("phi3",)  # and a rope.dimension_count below head_dim (Phi-4-mini)
_SOFTMAX_GATING = 1          # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
_CONTROL_TOKEN = 3           # gguf.TokenType.CONTROL
_END_OF_TURN_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "<|eot_id|>", "<|eom_id|>"})


def read_fields(reader) -> dict[str, object]:
    """The file's metadata, except the tokenizer's large arrays (transformers converts the tokenizer)."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
            "tokenizer.ggml.precompiled_charsmap")
    return {name: field.contents() for name, field in reader.fields.items() if name not in skip}


def gguf_hf_config(reader) -> dict:
    """The HF config dict of the file `reader` (a gguf.GGUFReader) reads; ModelLoadError for what
    radixlm does not implement (see the module docstring)."""
    fields = read_fields(reader)
    arch = str(fields.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    if int(fields.get("split.count", 1) or 1) > 1:
        raise ModelLoadError(f"This GGUF file is part 1 of {fields['split.count']} (a split file); loading "
                             "split files is not implemented: merge them first (llama-gguf-split --merge)")
    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}   # dims innermost first
    for name in tensors:
        if name.startswith("rope_factors_") and arch not in _LONGROPE_ARCHS:
            raise ModelLoadError(f"GGUF tensor {name}: LongRoPE rope factors are implemented for "
                                 f"{', '.join(_LONGROPE_ARCHS)} files only, not {arch}")
    keys = {name.removeprefix(arch + "."): value for name, value in fields.items() if name.startswith(arch + ".")}
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    hf: dict = {"architectures": [hf_arch], "model_type": model_type, "hidden_act": "silu"}
    hf.update({_READ[k]: v for k, v in keys.items() if k in _READ})
    if "vocab_size" not in hf:
        hf["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    hf["head_dim"] = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    hf["tie_word_embeddings"] = "output.weight" not in tensors
    hf["attention_bias"] = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    hf["rope_parameters"] = _rope(arch, keys, hf["head_dim"], reader)
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        if arch != "llama" or hf["rope_parameters"]["rope_type"] != "default":
            raise ModelLoadError(f"GGUF tensor rope_freqs in a {arch} file with rope scaling "
                                 f"{hf['rope_parameters'].get('rope_type')!r} is not implemented")
        hf["rope_parameters"].update(rope_type="freq_factors", freq_factors=_floats(factors))
    _check_attention(arch, keys, hf)
    unknown = sorted(set(keys) - set(_READ) - set(_CHECKED) - set(_INERT))
    if unknown:
        raise ModelLoadError(f"GGUF metadata {', '.join(f'{arch}.{k}={keys[k]!r}' for k in unknown)} "
                             f"is not implemented in radixlm")
    for token in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{token}_token_id" in fields:
            hf[f"{'pad' if token == 'padding' else token}_token_id"] = int(fields[f"tokenizer.ggml.{token}_token_id"])
    ends = [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom") if f"tokenizer.ggml.{k}_token_id" in fields]
    if arch != "llama":           # (llama files keep the stated ids only, as before)
        ends += _end_of_turn_ids(reader)
    if ends:
        hf["eos_token_id"] = [int(t) for t in dict.fromkeys(ends)]
    if arch in MOE_ARCHITECTURES:
        _moe(arch, keys, hf, tensors)
    elif int(keys.get("expert_count", 0) or 0) or any("_exps." in name for name in tensors):
        _mixtral(arch, keys, hf, tensors)
    if arch == "gemma2":
        _gemma2(hf)
    if arch == "gemma3":
        _gemma3(hf)
    return hf


def _floats(tensor) -> list[float]:
    from gguf import dequantize

    return [float(v) for v in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def _end_of_turn_ids(reader) -> list[int]:
    """Control tokens that end a turn, found by their text as llama.cpp finds them (a file states one
    eos id; the HF generation configs of these models list these too, e.g. Qwen's <|im_end|> and
    <|endoftext|>, Gemma's <end_of_turn>, Phi-3's <|end|>)."""
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.token_type" not in reader.fields:
        return []
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    return [i for i, (text, kind) in enumerate(zip(tokens, types, strict=False))
            if kind == _CONTROL_TOKEN and text in _END_OF_TURN_TEXTS]


def _rope(arch: str, keys: dict, head_dim: int, reader) -> dict:
    """rope_parameters: the base, linear scaling when the file states it, Phi-3's LongRoPE factors
    and partial rotary dimension; other scalings refused."""
    dims = keys.get("rope.dimension_count")
    rope = {"rope_type": "default", "rope_theta": float(keys.get("rope.freq_base", 10000.0))}
    if dims is not None and int(dims) != head_dim:
        if arch not in _PARTIAL_ROTARY_ARCHS or not 0 < int(dims) < head_dim:
            raise ModelLoadError(f"GGUF {arch}.rope.dimension_count={dims} (rope on part of each head of "
                                 f"{head_dim}) is not implemented for {arch} files")
        rope["partial_rotary_factor"] = int(dims) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_TENSORS[1:]}
    if factors:
        return _longrope(arch, keys, rope, factors)
    kind = str(keys.get("rope.scaling.type", "none"))
    factor = float(keys.get("rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear" and factor != 1.0:
        rope.update(rope_type="linear", factor=factor)
    elif kind not in ("none", "linear"):
        raise ModelLoadError(f"GGUF {arch}.rope.scaling.type={kind!r} (factor {factor}) is not implemented; "
                             "radixlm implements linear rope scaling")
    attn_factor = float(keys.get("rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:
        raise ModelLoadError(f"GGUF {arch}.rope.scaling.attn_factor={attn_factor} is not implemented")
    local = keys.get("rope.freq_base_swa")
    if arch == "gemma3":       # the sliding layers rotate unscaled, with base 10000 unless the file says
        return {"full_attention": rope, "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": float(local or 10000.0)}}
    if local is not None:
        raise ModelLoadError(f"GGUF {arch}.rope.freq_base_swa={local} (a rope base for sliding layers) "
                             f"is not implemented for {arch} files")
    return rope


def _longrope(arch: str, keys: dict, rope: dict, factors: dict) -> dict:
    """LongRoPE as llama.cpp's converter writes it for Phi-3: the long and short factor tensors, the
    original context in rope.scaling.original_context_length, the attention factor in
    rope.scaling.attn_factor (sqrt(1 + ln(s) / ln(original)), computed by the converter). llama.cpp
    picks the set from the context the way radixlm does (long when it exceeds the original)."""
    if len(factors) != 2:
        raise ModelLoadError(f"GGUF {arch} file has {', '.join(factors)} but not both rope_factors_long "
                             "and rope_factors_short")
    original = keys.get("rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF {arch} file with LongRoPE factors lacks "
                             f"{arch}.rope.scaling.original_context_length")
    kind = str(keys.get("rope.scaling.type", "none"))
    if kind not in ("none", "longrope", "su"):
        raise ModelLoadError(f"GGUF {arch}.rope.scaling.type={kind!r} together with LongRoPE factors "
                             "is not implemented")
    rope.update(rope_type="longrope", original_max_position_embeddings=int(original),
                long_factor=_floats(factors["rope_factors_long.weight"]),
                short_factor=_floats(factors["rope_factors_short.weight"]),
                attention_factor=float(keys.get("rope.scaling.attn_factor", 1.0)))
    return rope


def _check_attention(arch: str, keys: dict, hf: dict) -> None:
    value_length = keys.get("attention.value_length")
    if value_length is not None and int(value_length) != hf["head_dim"]:
        raise ModelLoadError(f"GGUF {arch}.attention.value_length={value_length} differs from the key length "
                             f"{hf['head_dim']}; not implemented")
    if not keys.get("attention.causal", True):
        raise ModelLoadError(f"GGUF {arch}.attention.causal=false (non-causal attention) is not supported")
    if hf.get("sliding_window") and arch not in ("phi3", "gemma2", "gemma3"):
        raise ModelLoadError(f"GGUF {arch}.attention.sliding_window is not implemented for {arch} files")
    if not hf.get("sliding_window"):
        hf.pop("sliding_window", None)


def _moe(arch: str, keys: dict, hf: dict, tensors: dict[str, list[int]]) -> None:
    """Expert settings: sizes from the tensors when the keys are absent; layers without a router are dense."""
    gating = keys.get("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise ModelLoadError(f"GGUF {arch}.expert_gating_func={gating} is not implemented (softmax routing only)")
    if "moe_intermediate_size" not in hf and "blk.0.ffn_gate_exps.weight" in tensors:
        hf["moe_intermediate_size"] = tensors["blk.0.ffn_gate_exps.weight"][1]   # [hidden, inter, experts]
    shared = next((s for n, s in tensors.items() if n.endswith("ffn_gate_shexp.weight")), None)
    if arch == "qwen2moe":
        hf.setdefault("shared_expert_intermediate_size", shared[1] if shared else 0)
    elif shared is not None:
        raise ModelLoadError(f"GGUF {arch} file has shared-expert tensors, which {arch} does not use")
    # llama.cpp renormalizes the top-k weights for Qwen3-MoE and not for Qwen2-MoE, unless the file says
    hf.setdefault("norm_topk_prob", arch == "qwen3moe")
    hf["norm_topk_prob"] = bool(hf["norm_topk_prob"])
    hf["decoder_sparse_step"] = 1
    hf["mlp_only_layers"] = [i for i in range(int(hf["num_hidden_layers"]))
                             if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if "intermediate_size" not in hf:       # an all-expert file states no dense width
        hf["intermediate_size"] = hf["moe_intermediate_size"]


def _mixtral(arch: str, keys: dict, hf: dict, tensors: dict[str, list[int]]) -> None:
    """A llama file with experts is Mixtral (llama.cpp converts it as llama): experts of
    feed_forward_length on every layer, top-k weights renormalized."""
    layers = int(hf["num_hidden_layers"])
    if arch != "llama" or any(f"blk.{i}.ffn_gate_exps.weight" not in tensors for i in range(layers)):
        raise ModelLoadError(f"GGUF {arch} file with experts (3-D ffn_*_exps on every layer, as llama.cpp "
                             "writes Mixtral) is not supported in this form")
    size = hf.pop("moe_intermediate_size", None)
    if size is not None and int(size) != int(hf["intermediate_size"]):
        raise ModelLoadError(f"GGUF {arch}.expert_feed_forward_length={size} differs from feed_forward_length "
                             f"{hf['intermediate_size']}; not implemented for Mixtral-style files")
    if any(f"blk.{i}.ffn_gate_shexp.weight" in tensors for i in range(layers)):
        raise ModelLoadError(f"GGUF {arch} file with shared experts is not supported")
    hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
              num_local_experts=int(hf.pop("num_experts")), num_experts_per_tok=int(hf["num_experts_per_tok"]))


def _gemma2(hf: dict) -> None:
    """llama.cpp's fixed Gemma 2 rules: GeGLU (gelu-tanh), every even layer sliding when the file has
    a window (llama.cpp's swa pattern 2), one rope base, the attention scale of Gemma 3's rule (the
    46-layer 27B: hidden / heads); the soft-caps are read from the file's keys."""
    layers = int(hf["num_hidden_layers"])
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf.pop("hidden_act")
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if layers == 46 else hf["head_dim"]
    if hf.get("sliding_window"):
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:
        hf.pop("sliding_window", None)
        hf["layer_types"] = ["full_attention"] * layers


def _gemma3(hf: dict) -> None:
    """llama.cpp's fixed Gemma 3 rules for what the file does not state (see the module docstring)."""
    layers = int(hf["num_hidden_layers"])
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf.pop("hidden_act")
    big = layers == 62                      # llama.cpp's LLM_TYPE_27B
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]
    if hf.get("sliding_window"):
        hf["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    else:
        hf.pop("sliding_window", None)
        hf["layer_types"] = ["full_attention"] * layers
