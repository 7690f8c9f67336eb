"""GGUF loading: the q/k permutation, tensor names, format errors, and SmolLM2 logits against HF.

The last test loads the real SmolLM2-135M-Instruct GGUF (tests/real_model.py) into our Llama in
fp32 and compares logits with transformers' own GGUF loader on a 1,000-token real-text prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlm.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.runtime.mem_cache.kv_manager import write_slots
from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.models.gguf_loader import hf_tensor_name, materialize_gguf, unpermute_qk
from radixlm.runtime.models.model_config import ModelConfig, ModelLoadError
from radixlm.runtime.models.resolve import find_gguf_file, resolve_model_source
from radixlm.runtime.models.weight_loader import load_model
from tests.real_model import hf_reference, real_text_ids, smollm2_gguf


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows (rotate-half -> pairs)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_permute(num_heads: int) -> None:
    weight = torch.randn(num_heads * 64, 40)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, num_heads), weight)
    # per head, row i*half + j of HF's layout sits at row 2*j + i in llama.cpp's
    assert torch.equal(permuted[1], weight[32]) and torch.equal(permuted[2], weight[1])


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def _write_gguf(path: Path, arch: str) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    _write_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported; supported: llama"):
        materialize_gguf(tmp_path / "m.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model_source(str(tmp_path / "bad.gguf"))


def test_gguf_file_lookup(tmp_path: Path) -> None:
    assert find_gguf_file(str(tmp_path), "auto") is None
    with pytest.raises(ModelLoadError, match="exactly one"):
        find_gguf_file(str(tmp_path), "gguf")
    _write_gguf(tmp_path / "a.gguf", "llama")
    assert find_gguf_file(str(tmp_path), "gguf") == (tmp_path / "a.gguf").resolve()
    assert find_gguf_file(str(tmp_path / "a.gguf"), "auto") == (tmp_path / "a.gguf").resolve()
    with pytest.raises(ModelLoadError, match="--load-format is safetensors"):
        find_gguf_file(str(tmp_path / "a.gguf"), "safetensors")
    _write_gguf(tmp_path / "b.gguf", "llama")
    with pytest.raises(ModelLoadError, match="2 .gguf files"):
        find_gguf_file(str(tmp_path), "gguf")
    with pytest.raises(ModelLoadError, match="Unknown load format"):
        resolve_model_source(str(tmp_path), "pickle")


@torch.no_grad()
def _prefill_logits(model: torch.nn.Module, config: ModelConfig, ids: list[int], page_size: int) -> torch.Tensor:
    """One EXTEND pass of `ids` over a fresh paged KV cache (torch_native); logits [len(ids), vocab]."""
    num_pages = len(ids) // page_size + 2
    pool = ReqToTokenPool(1, config.context_len, "cpu")
    alloc = TokenToKVPoolAllocator(num_pages, page_size)
    kv = KVCache(num_pages, page_size, config.num_layers, config.num_kv_heads, config.head_dim, config.dtype, "cpu")
    out_loc = alloc.alloc_extend([0], [len(ids)], [0])
    write_slots(pool.req_to_token, [0], [0], [len(ids)], out_loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [0], [0], [len(ids)], out_loc, pool, kv, "cpu")
    fb.attn_backend = TorchNativeAttnBackend()
    fb.attn_backend.init_forward_metadata(fb)
    return model.compute_logits(model(fb.input_ids, fb.positions, fb))


def test_smollm2_logits_match_hf_on_1000_real_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_DISABLE_GGUF_QUANT", "1")   # the dequantized weights HF computes with
    path = smollm2_gguf()
    config = ModelConfig.from_path(path, dtype="float32")
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == \
        ("LlamaForCausalLM", 30, 9, 3)
    assert config.tie_word_embeddings and config.gguf_file == str(Path(path).resolve())
    assert ModelConfig.from_path(path).dtype == torch.bfloat16   # 'auto' serves GGUF in bf16
    hf_model, tokenizer = hf_reference()
    ids = real_text_ids(tokenizer, 1000)
    ours = _prefill_logits(load_model(config, "cpu", show_progress=False), config, ids, page_size=16)
    theirs = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-3, f"max abs logit diff {diff}"


def test_short_name_resolves_to_the_wheel_file() -> None:
    from radixlm.runtime.server_args import ServerArgs

    path = smollm2_gguf()
    args = ServerArgs(model_path="smollm2-135m-instruct").resolved()
    assert args.model_path == str(Path(path).resolve()) and args.served_model_name == "smollm2-135m-instruct"
    folder = Path(args.tokenizer_path)
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in folder.iterdir()}
    assert "<|im_start|>" in (folder / "chat_template.jinja").read_text()
