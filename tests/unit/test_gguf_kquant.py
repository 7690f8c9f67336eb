"""A tiny random Llama written as a Q4_K_M-style GGUF, loaded by radixlm with the k-quants kept
quantized, logits against transformers' GGUF loader on the same file.

Types as llama.cpp's Q4_K_M assigns them: Q4_K for most 2-D weights, Q6_K for the LM head and for
attn_v / ffn_down of the first layer (llama.cpp's `use_more_bits` layers); plus one Q5_K (layer 1's
attn_k, so every k-quant runs in a model), one Q8_0 (layer 1's o_proj, the mix with the 32-block
types) and F32 norms. The weights are random valid blocks (random codes and scales, fp16 super-block
scales chosen for a weight std about 0.05), so fused qkv and the first layer's projections mix types.
Tolerances as tests/unit/test_gguf_quant.py: kernel off, our torch dequantize-then-matmul in fp32
against transformers' fp32: 1e-4 of the max |logit|; kernel on, int8 activations per 32-block
(about 1% of a product per matmul, here with 256 inputs per block row) over 2 layers and the head:
5% of the max |logit| (measured: printed) and the greedy tokens agree on >= 90% of positions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu_quant import cpu_supports_quant
from radixlm.runtime.layers.quant_linear import QuantWeight
from radixlm.runtime.models.model_config import ModelConfig
from radixlm.runtime.models.weight_loader import load_model
from tests.unit.test_gguf_loader import _prefill_logits

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 512, 256
Q4_K, Q5_K, Q6_K, Q8_0 = 12, 13, 14, 8
BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
# fp16 scale offsets in a block and their value range for a weight std about 0.05 (see the module doc)
SCALES = {Q4_K: ((0, 2e-4), (2, 7.5 * 2e-4)), Q5_K: ((0, 1e-4), (2, 15.5 * 1e-4)), Q6_K: ((208, 4e-5),)}


def random_kquant(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * bytes] uint8 of random valid `qtype` blocks (any bytes are valid codes and
    6-bit/int8 scales; the fp16 ones are set to [0.5, 1.5) x the type's value in SCALES)."""
    raw = rng.integers(0, 256, size=(rows * cols // 256, BYTES[qtype]), dtype=np.uint8)
    for at, value in SCALES[qtype]:
        raw[:, at:at + 2] = (value * rng.uniform(0.5, 1.5, (raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def q4_k_m_type(name: str) -> int:
    """The GGUF type of a 2-D weight in this test's Q4_K_M-style file."""
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return Q6_K
    return {"blk.1.attn_k.weight": Q5_K, "blk.1.attn_output.weight": Q8_0}.get(name, Q4_K)


def write_q4_k_m_gguf(folder: Path, tokenizer_from: str | None = None) -> tuple[Path, Path]:
    """(the .gguf file, an HF config folder) of a random tiny Llama typed as q4_k_m_type says. With
    `tokenizer_from` (a .gguf) its tokenizer metadata is copied and sets the vocabulary, so the file
    also loads by path."""
    from transformers import LlamaConfig

    tokenizer = gguf.GGUFReader(tokenizer_from) if tokenizer_from else None
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents()) if tokenizer else VOCAB
    config = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=vocab,
                         max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
    hd = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN), "attn_v": (KV_HEADS * hd, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    rng = np.random.default_rng(30)
    path = folder / "gguf" / "tiny-q4_k_m.gguf"
    path.parent.mkdir()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    for name, field in (tokenizer.fields.items() if tokenizer else ()):
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub)

    def add(name: str, rows: int, cols: int) -> None:
        t = q4_k_m_type(name)
        raw = (gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                                    gguf.GGMLQuantizationType(t)) if t == Q8_0 else random_kquant(t, rows, cols, rng))
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(t))

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    add("token_embd.weight", vocab, HIDDEN)
    w.add_tensor("output_norm.weight", norm())
    add("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for piece, (rows, cols) in shapes.items():
            add(f"blk.{i}.{piece}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = folder / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    return path, hf


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> tuple[Path, Path, torch.Tensor, list[int]]:
    """The file, its HF folder, transformers' fp32 logits on 40 random tokens, and the tokens."""
    from transformers import AutoModelForCausalLM

    path, hf = write_q4_k_m_gguf(tmp_path_factory.mktemp("q4_k_m"))
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(30)).tolist()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    return path, hf, theirs, ids


@pytest.mark.parametrize("kernel", [True, False])
def test_q4_k_m_logits_match_transformers(q4_k_m_file, monkeypatch, kernel):
    path, hf, theirs, ids = q4_k_m_file
    if kernel and not cpu_supports_quant():
        pytest.skip("needs AVX512-VNNI")
    if not kernel:
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
    config = dataclasses.replace(ModelConfig.from_path(str(hf), dtype="float32"), gguf_file=str(path))
    model = load_model(config, "cpu", show_progress=False, disable_gguf_quant=False)
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    qkv = layer0.self_attn.qkv_proj.packed_weight
    assert isinstance(qkv, QuantWeight) and [(p.qtype, p.rows, p.packed) for p in qkv.parts] == \
        [(Q4_K, HIDDEN + KV_HEADS * HIDDEN // HEADS, kernel), (Q6_K, KV_HEADS * HIDDEN // HEADS, kernel)]
    assert [p.qtype for p in layer1.self_attn.qkv_proj.packed_weight.parts] == [Q4_K, Q5_K, Q4_K]
    assert [p.qtype for p in layer0.mlp.down_proj.packed_weight.parts] == [Q6_K]
    assert [p.qtype for p in layer1.self_attn.o_proj.packed_weight.parts] == [Q8_0]
    assert [p.qtype for p in model.lm_head.packed_weight.parts] == [Q6_K]
    assert [p.qtype for p in model.model.embed_tokens.quant_weight.parts] == [Q4_K]
    assert layer0.self_attn.qkv_proj.weight.numel() == 0
    ours = _prefill_logits(model, config, ids, page_size=16)
    diff, top = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    print(f"kernel={kernel}: max |logit diff| {diff:.3g} of max |logit| {top:.3g}")
    if not kernel:
        assert diff <= 1e-4 * top, (diff, top)
        return
    assert diff <= 0.05 * top, (diff, top)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
