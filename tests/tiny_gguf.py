"""Writes a transformers model as a GGUF file the way llama.cpp's converter does, for tests.

`write_gguf(model, arch, path, qtype)` takes a (tiny, random) HF model and writes `path` with
metadata under llama.cpp's key names, a tiny byte-level BPE tokenizer (so the file loads by path:
transformers converts it, as it does a real file's), and every tensor under its GGUF name, found
with the gguf package's own HF -> GGUF name map (independent of radixlm's reverse tables). What
llama.cpp's converter changes, this changes too:

    llama                 q/k rows permuted per head (rotate-half -> interleaved pairs); llama3
                          rope scaling stored as the rope_freqs tensor of per-frequency divisors
    gemma2 / gemma3       every RMSNorm weight stored as w + 1; gemma2's soft-caps as metadata
    qwen2moe / qwen3moe   (and Mixtral, written as llama) experts stacked as 3-D ffn_{gate,up,down}_exps [experts, out, in];
                          the shared-expert gate stored 1-D
    phi3                  the fused qkv_proj / gate_up_proj kept fused (attn_qkv, ffn_up); the rope
                          dimension (partial_rotary_factor) and original context always stated;
                          LongRoPE as the rope_factors_long / rope_factors_short tensors plus the
                          attention factor the converter computes
    olmo2                 nothing (its converter keeps HF's tensors and layout; names from the map:
                          post_attention_norm, post_ffw_norm, attn_q_norm, attn_k_norm)

2-D weights (and experts) are written in `qtype` (F32, F16 or a quantized type), 1-D tensors in F32,
as llama.cpp does. Quantizing uses gguf.quants (numpy), so keep the models tiny.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def add_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of `vocab_size` tokens: 256 bytes, a few merges, special tokens."""
    import gguf

    tokens = byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += SPECIAL_TOKENS
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([normal if i < 256 + len(merges) else control for i in range(vocab_size)])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_metadata(writer, arch: str, config) -> None:
    """The hyperparameters llama.cpp's converter writes for `arch`."""
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size)
                                        // c.num_attention_heads)
        original = rope.get("original_max_position_embeddings", c.original_max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = c.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original))
                                                 if scale > 1.0 else 1.0)
    if getattr(c, "num_local_experts", None):           # Mixtral, written as llama
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch in ("gemma2", "gemma3", "phi3") and c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    if "sliding_attention" in c.rope_parameters:        # the newer converter states the sliding layers' base
        writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])


def _permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's llama q/k row order: per head, HF row i*half + j goes to 2*j + i."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array, transformed as llama.cpp's converter transforms them."""
    import gguf

    c = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, w in model.state_dict().items():
        w = w.float()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):       # [experts, 2 * inter, hidden]: gate rows first
            block = name.split(".")[2]
            gate, up = w.chunk(2, dim=1)
            out[f"blk.{block}.ffn_gate_exps.weight"] = gate.numpy()
            out[f"blk.{block}.ffn_up_exps.weight"] = up.numpy()
            continue
        base, _, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "weight")
        gguf_name = name_map.get_name(base)
        assert gguf_name is not None, name
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1.0
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)
        out[f"{gguf_name}.{suffix}"] = w.numpy()
    return out


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's rope_freqs for an HF llama3 rope scaling: the divisor of each frequency."""
    rope = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, arch: str, path: Path, qtype: int) -> Path:
    """Writes `model` (a transformers causal LM) as the GGUF file `path`; weights in ggml type `qtype`."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, arch, model.config)
    add_tokenizer(writer, model.config.vocab_size)
    kind = gguf.GGMLQuantizationType(qtype)
    tensors = gguf_tensors(model, arch)
    if model.config.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(model.config)
    if model.config.rope_parameters.get("rope_type") == "longrope":
        for which in ("long", "short"):
            tensors[f"rope_factors_{which}.weight"] = np.array(model.config.rope_parameters[f"{which}_factor"],
                                                              dtype=np.float32)
    for name, w in tensors.items():
        if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
            writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
