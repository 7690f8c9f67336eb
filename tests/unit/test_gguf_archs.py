"""GGUF files beyond Llama: Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Phi-3 and Gemma 3, against transformers.

For each architecture a tiny random HF model (initializer_range 0.1, untied embeddings except
Gemma 3, which ties them) is written to a GGUF file here as llama.cpp's converter writes it
(tests/tiny_gguf.py: metadata keys, tensor names from the gguf package's own map, the converter's
transforms), in F32, F16 and Q8_0. The file is loaded by path (ModelConfig.from_path converts its
metadata, load_model its tensors) and compared with transformers' `from_pretrained(gguf_file=...)`
on the same file, both fp32, on a 40-token prompt (longer than Gemma 3's 16-token window):

- F32, F16 (dequantized exactly to fp32 by both), and Q8_0 with the CPU kernel off (our torch dequantize-then-matmul): the same fp32 weights
  and fp32 math as transformers, summed in other orders: 1e-4 absolute on the logits (max |logit|
  is about 1-3 here), and the same greedy token at every position.
- Q8_0 kept quantized with the kernel on: every matmul rounds its input to int8 per 32-block; as in
  test_gguf_quant.py (measured 2-3% there) the bound is 5% of the max |logit| and the greedy tokens
  agree on >= 90% of the positions. MoE models get the 5% bound on >= 90% of the positions instead
  of all: the int8 rounding upstream can flip a near-tie between two experts in a router's top-k,
  and that token's output then differs by a whole expert (measured: 3 of 40 positions over 0.05 *
  max |logit| on the Qwen3-MoE file, against our own kernel-off logits; the others at 1%).

Gemma 3 has head_dim 256 and 6 layers because transformers takes what the file does not state
from Gemma3TextConfig's defaults (query_pre_attn_scalar 256, every 6th layer global), which are
llama.cpp's rules for these files only when head_dim is 256. Where transformers reads less of the
file than radixlm (Qwen2-MoE's and Qwen3-MoE's expert sizes, Qwen3's head_dim), its config comes
from the tiny model instead (`from_pretrained(..., config=...)`, the weights still from the file),
and our converted config is checked against the tiny model's own.

Also here: refusals of metadata radixlm does not implement; linear rope scaling read; Llama 3.1
rope (llama.cpp's rope_freqs tensor), Mixtral (a llama file with experts) and OLMo 2 (olmo2 files,
F32 and Q8_0; OLMo 3's sliding-window files refused) against the tiny HF models themselves, since
transformers' GGUF loader reads none of them; a Qwen3 file by path through the
scheduler; the one-call CPU decoder on quantized Qwen2/Qwen3 files, bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu_quant import cpu_supports_quant
from radixlm.runtime.layers.quant_linear import QuantWeight
from radixlm.runtime.models.model_config import ModelConfig, ModelLoadError
from radixlm.runtime.models.weight_loader import load_model
from tests.tiny_gguf import write_gguf
from tests.unit.test_gguf_loader import _prefill_logits

gguf = pytest.importorskip("gguf")

F32, F16, Q8_0 = 0, 1, 8
VOCAB = 320
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# general.architecture -> radixlm architecture, and whether transformers reads the whole config from the file
ARCHS = {"qwen2": ("Qwen2ForCausalLM", True), "qwen3": ("Qwen3ForCausalLM", False),
         "qwen2moe": ("Qwen2MoeForCausalLM", False), "qwen3moe": ("Qwen3MoeForCausalLM", False),
         "phi3": ("Phi3ForCausalLM", True), "gemma2": ("Gemma2ForCausalLM", False),
         "gemma3": ("Gemma3ForCausalLM", True)}


def hf_config(arch: str):
    import transformers as tf

    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, num_hidden_layers=2)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32)
    if arch == "qwen2moe":     # every layer sparse: llama.cpp's qwen2moe has no dense layers
        return tf.Qwen2MoeConfig(**COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=False)
    if arch == "qwen3moe":
        return tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
    if arch == "phi3":
        return tf.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=64)   # longer than the prompt:
        # transformers' GGUF reading drops the window (llama.cpp disables Phi-3's); radixlm keeps it
    if arch == "gemma2":     # a cap small enough to change every layer, a 16-token window on even layers
        return tf.Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=4, head_dim=32,
                               query_pre_attn_scalar=32, sliding_window=16, attn_logit_softcapping=1.0,
                               final_logit_softcapping=30.0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    gemma = dict(tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1, head_dim=256)
    return tf.Gemma3TextConfig(**{**COMMON, **gemma}, num_hidden_layers=6, sliding_window=16,
                               query_pre_attn_scalar=256, rope_parameters=rope)


@pytest.fixture(scope="module")
def tiny_models():
    """arch -> the tiny random HF model (fp32, eval), built once per module."""
    from transformers import AutoModelForCausalLM

    models = {}
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
        if arch in ("gemma2", "gemma3"):          # (1 + w) norms: w away from 0, so a lost +-1 shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.data.uniform_(-0.5, 0.5)
        models[arch] = model
    return models


def _hf_from_file(path: Path, arch: str, tiny) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    extra = {} if ARCHS[arch][1] else {"config": tiny.config}
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                **extra).eval()


def _check_config(config: ModelConfig, arch: str, tiny) -> None:
    """Our config converted from the file says what the tiny model's own config says."""
    c = tiny.config
    assert config.architecture == ARCHS[arch][0]
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == \
        (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size)
    assert config.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert config.tie_word_embeddings == c.tie_word_embeddings
    # the file's eos (<|im_end|>) and the other control token that ends a turn (<|endoftext|>)
    assert config.eos_token_ids == [263, 261]
    if config.moe is not None:
        moe = config.moe
        assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == \
            (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob)
        assert moe.shared_intermediate_size == getattr(c, "shared_expert_intermediate_size", 0)
        assert moe.sparse_layers == tuple(range(c.num_hidden_layers))
    if arch == "phi3":
        assert config.sliding_window == 64 and config.sliding_window_layers == (0, 1)
    if arch == "gemma2":
        assert config.sliding_window == 16 and config.sliding_window_layers == (0, 2)
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (1.0, 30.0)
        assert config.query_pre_attn_scalar == 32 and config.hidden_act == "gelu_pytorch_tanh"
    if arch == "gemma3":
        assert config.sliding_window == 16 and config.sliding_window_layers == (0, 1, 2, 3, 4)
        assert (config.query_pre_attn_scalar, config.local_rope_theta, config.rope_theta) == (256, 10000.0, 1e6)
        assert config.hidden_act == "gelu_pytorch_tanh"


def q8_rounded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose matrices are Q8_0-rounded as the file stores them (norms and vectors stay)."""
    import copy

    out = copy.deepcopy(model)
    kind = gguf.GGMLQuantizationType(Q8_0)
    for name, p in out.named_parameters():
        if p.dim() >= 2 and "norm" not in name:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(p.detach().numpy(), kind), kind)
            p.data.copy_(torch.from_numpy(rounded.reshape(p.shape)))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("qtype,kernel", [(F32, True), (F16, True), (Q8_0, True), (Q8_0, False)])
def test_gguf_logits_match_transformers(arch, qtype, kernel, tiny_models, tmp_path, monkeypatch):
    if qtype == Q8_0 and kernel and not cpu_supports_quant():
        pytest.skip("needs AVX512-VNNI")
    if not kernel:
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny = tiny_models[arch]
    path = write_gguf(tiny, arch, tmp_path / "gguf" / f"{arch}.gguf", qtype)
    config = ModelConfig.from_path(str(path), dtype="float32")
    _check_config(config, arch, tiny)
    model = load_model(config, "cpu", show_progress=False, disable_gguf_quant=False)
    if qtype == Q8_0:                                 # kept quantized, experts included
        mlp = model.model.layers[0].mlp
        layer = mlp.experts[1] if config.moe else mlp
        assert isinstance(layer.gate_up_proj.packed_weight, QuantWeight)
        assert isinstance(model.model.layers[1].self_attn.qkv_proj.packed_weight, QuantWeight)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = _prefill_logits(model, config, ids, page_size=16)
    with torch.no_grad():
        theirs = _hf_from_file(path, arch, tiny)(torch.tensor([ids])).logits[0]
    diff, top = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    if qtype in (F32, F16) or not kernel:
        assert diff <= 1e-4, (diff, top)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        return
    per_position = (ours - theirs).abs().max(-1).values
    if config.moe is None:
        assert diff <= 0.05 * top, (diff, top)
    else:                                             # a flipped near-tie in the router moves a whole expert
        assert (per_position <= 0.05 * top).float().mean() >= 0.9, (per_position.tolist(), top)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_gguf_bf16_serving_dtype_by_default(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_models["qwen3"], "qwen3", tmp_path / "gguf" / "qwen3.gguf", F32)
    assert ModelConfig.from_path(str(path)).dtype == torch.bfloat16


def _with_key(src: Path, dst: Path, key: str, value, vtype) -> Path:
    """A copy of the GGUF file `src` with one more metadata key."""
    reader = gguf.GGUFReader(str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed([int(d) for d in t.shape])),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("key,value,vtype,message", [
    ("qwen2.rope.scaling.type", "yarn", gguf.GGUFValueType.STRING, "rope.scaling.type='yarn'"),
    ("qwen2.rope.dimension_count", 8, gguf.GGUFValueType.UINT32, "rope on part of each head"),
    ("qwen2.attention.sliding_window", 8, gguf.GGUFValueType.UINT32, "sliding_window is not implemented for qwen2"),
    ("qwen2.attention.value_length", 8, gguf.GGUFValueType.UINT32, "value_length=8 differs"),
    ("qwen2.some_new_key", 1, gguf.GGUFValueType.UINT32, "qwen2.some_new_key=1 is not implemented"),
    ("split.count", 3, gguf.GGUFValueType.UINT16, "part 1 of 3 (a split file)"),
])
def test_unimplemented_gguf_metadata_is_refused(key, value, vtype, message, tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_models["qwen2"], "qwen2", tmp_path / "src" / "qwen2.gguf", F32)
    bad = _with_key(path, tmp_path / "bad.gguf", key, value, vtype)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        ModelConfig.from_path(str(bad))


def test_linear_rope_scaling_is_read(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_models["qwen2"], "qwen2", tmp_path / "src" / "qwen2.gguf", F32)
    once = _with_key(path, tmp_path / "a" / "a.gguf", "qwen2.rope.scaling.type", "linear", gguf.GGUFValueType.STRING)
    twice = _with_key(once, tmp_path / "b.gguf", "qwen2.rope.scaling.factor", 4.0, gguf.GGUFValueType.FLOAT32)
    config = ModelConfig.from_path(str(twice))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0, "rope_theta": config.rope_theta}
    assert dataclasses.replace(config).rope_theta == tiny_models["qwen2"].config.rope_parameters["rope_theta"]


def test_scheduler_serves_a_gguf_file_by_path(tiny_models, tmp_path, monkeypatch):
    """A Qwen3 file by path through the real Scheduler (ServerArgs resolves the file and converts its
    tokenizer; radix cache, chunked prefill, pages of 16, mixed prefill/decode batches): greedy
    tokens equal transformers' on the same file, and the second round is served from the cache."""
    from pathlib import Path as _Path

    from tests.helpers import SchedulerHarness

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny = tiny_models["qwen3"]
    path = write_gguf(tiny, "qwen3", tmp_path / "gguf" / "qwen3.gguf", F32)
    hf = _hf_from_file(path, "qwen3", tiny)
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 20)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
                    [0, len(ids):].tolist() for ids in prompts]
    h = SchedulerHarness(str(path), page_size=16, chunked_prefill_size=32, context_length=256, max_total_tokens=2048)
    assert (_Path(h.args.tokenizer_path) / "tokenizer.json").is_file()
    for attempt in range(2):
        for i, ids in enumerate(prompts):
            h.submit(f"{attempt}-{i}", ids, max_new_tokens=6, temperature=0, ignore_eos=True)
        res = h.run()
        assert [res[f"{attempt}-{i}"]["output_ids"] for i in range(2)] == expected, f"round {attempt}"
    assert all(res[f"1-{i}"]["cached_tokens"] >= 32 for i in range(2))


def test_llama3_rope_factors_from_a_llama_file(tmp_path, monkeypatch):
    """llama.cpp stores Llama 3.1 rope scaling as the rope_freqs tensor (no metadata key);
    transformers' GGUF loader drops it, so the reference is the tiny HF model itself (fp32, its
    llama3 rope_parameters). Orig. context 64 so the scaling changes frequencies at tiny sizes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    torch.manual_seed(5)
    tiny = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope),
                                            dtype=torch.float32).eval()
    path = write_gguf(tiny, "llama", tmp_path / "gguf" / "llama3.gguf", F32)
    config = ModelConfig.from_path(str(path), dtype="float32")
    assert config.rope_scaling["rope_type"] == "freq_factors" and max(config.rope_scaling["freq_factors"]) == 8.0
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ours = _prefill_logits(load_model(config, "cpu", show_progress=False), config, ids, page_size=16)
    with torch.no_grad():
        theirs = tiny(torch.tensor([ids])).logits[0]
        dropped = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)(
            torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (dropped - theirs).abs().max().item() > 1e-2          # the factors matter here


@pytest.mark.parametrize("qtype,kernel", [(F32, True), (Q8_0, False)])
def test_mixtral_from_a_llama_file(qtype, kernel, tmp_path, monkeypatch):
    """llama.cpp writes Mixtral as a llama file with experts; transformers' GGUF loader builds a
    dense Llama from it, so the reference is the tiny HF Mixtral itself (fp32); 1e-4 for F32 and
    for Q8_0 on the torch path, against the HF model with its weights rounded to Q8_0 in place
    (gguf.quants round trip per row: the file's rows up to a row order, and blocks lie in a row)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    if not kernel:
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(9)
    tiny = AutoModelForCausalLM.from_config(
        MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
        dtype=torch.float32).eval()
    path = write_gguf(tiny, "llama", tmp_path / "gguf" / "mixtral.gguf", qtype)
    config = ModelConfig.from_path(str(path), dtype="float32")
    assert config.architecture == "MixtralForCausalLM" and config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 96)
    model = load_model(config, "cpu", show_progress=False, disable_gguf_quant=False)
    assert isinstance(model.model.layers[0].mlp.experts[3].down_proj.packed_weight, QuantWeight) == (qtype == Q8_0)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(10)).tolist()
    ours = _prefill_logits(model, config, ids, page_size=16)
    reference = tiny
    if qtype == Q8_0:
        reference = q8_rounded_copy(tiny)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_one_call_decoder_on_quantized_qwen_files(arch, tiny_models, tmp_path, monkeypatch):
    """The one-call CPU decoder on Q8_0 Qwen2 (q/k/v bias) and Qwen3 (q/k norms) files, weights kept
    quantized: the same hidden states and K/V writes as the Python forward, bit for bit, over 3 decode steps of a
    ragged batch (as tests/unit/test_cpu_decoder.py checks the Llama files)."""
    from radixlm.kernels.cpu_decoder import load_cpu_decoder
    from tests.unit.test_cpu_decoder import _runner, assert_decoder_matches_python_forward

    decoder_ext = load_cpu_decoder()
    if decoder_ext is None or not decoder_ext.with_quant:
        pytest.skip("decoder built without the quantized kernel (no AVX512-VNNI)")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_models[arch], arch, tmp_path / "gguf" / f"{arch}.gguf", Q8_0)
    runner = _runner(str(path), "bfloat16")
    assert runner.model.model.layers[0].self_attn.qkv_proj.packed_weight.parts[0].packed
    assert_decoder_matches_python_forward(runner)


@pytest.mark.parametrize("layers,scalar", [(62, 5376 // 32), (48, 128)])
def test_gemma3_attention_scale_follows_llama_cpp(layers, scalar, tmp_path):
    """llama.cpp scales Gemma 3's attention by head_dim ** -0.5, except the 62-layer 27B, which
    takes hidden/heads (168, not its head_dim 128); no key states it. Metadata-only files."""
    from radixlm.runtime.models.gguf_config import gguf_hf_config

    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    for add, value in ((writer.add_block_count, layers), (writer.add_embedding_length, 5376),
                       (writer.add_head_count, 32), (writer.add_head_count_kv, 16), (writer.add_key_length, 128),
                       (writer.add_value_length, 128), (writer.add_feed_forward_length, 21504),
                       (writer.add_context_length, 131072), (writer.add_sliding_window, 1024),
                       (writer.add_vocab_size, 262208)):
        add(value)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf = gguf_hf_config(gguf.GGUFReader(str(tmp_path / "g.gguf")))
    assert hf["query_pre_attn_scalar"] == scalar and hf["head_dim"] == 128
    assert hf["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert hf["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert hf["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("qtype", [F32, Q8_0])
def test_phi3_longrope_and_partial_rotary_file(qtype, tmp_path, monkeypatch):
    """A Phi-4-mini-shaped phi3 file (LongRoPE factor tensors, rope.dimension_count 12 of head_dim 16,
    original context 64 of 256). transformers' GGUF loader reads neither the factors nor the rope
    dimension, so the reference is the tiny HF model itself (fp32, as from safetensors): served with
    context 64 (short factors) on a 40-token prompt and with 256 (long factors) on an 80-token one,
    logits within 1e-4 (F32; Q8_0, dequantized, against the HF model with Q8_0-rounded weights) and
    greedy equal."""

    from transformers import AutoModelForCausalLM

    from tests.unit.test_phi3_longrope import phi3_config

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(11)
    tiny = AutoModelForCausalLM.from_config(phi3_config(0.75), dtype=torch.float32).eval()
    path = write_gguf(tiny, "phi3", tmp_path / "gguf" / "phi4mini.gguf", qtype)
    reference = tiny
    if qtype == Q8_0:        # dequantized weights, fp32 activations: the reference's arithmetic
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
        reference = q8_rounded_copy(tiny)
    for context, length in ((64, 40), (256, 80)):
        config = ModelConfig.from_path(str(path), dtype="float32", context_length=context)
        assert config.rotary_dim == 12 and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == 64
        ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(context)).tolist()
        ours = _prefill_logits(load_model(config, "cpu", show_progress=False, disable_gguf_quant=False), config, ids, page_size=16)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max().item() <= 1e-4
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_longrope_factors_refused_outside_phi3(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    from tests.tiny_gguf import add_metadata, add_tokenizer, gguf_tensors

    add_metadata(writer, "qwen2", tiny_models["qwen2"].config)
    add_tokenizer(writer, VOCAB)
    tensors = gguf_tensors(tiny_models["qwen2"], "qwen2")
    tensors["rope_factors_long.weight"] = tensors["rope_factors_short.weight"] = torch.ones(8).numpy()
    for name, w in tensors.items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="LongRoPE rope factors"):
        ModelConfig.from_path(str(path))


def olmo2_tiny() -> torch.nn.Module:
    """A tiny random HF OLMo 2 (fp32, eval) with its norms (post-attention, post-MLP, q/k over the whole
    projection, final) moved off 1, so a lost or misplaced norm shows."""
    from transformers import AutoModelForCausalLM, Olmo2Config

    torch.manual_seed(12)
    tiny = AutoModelForCausalLM.from_config(Olmo2Config(**COMMON, num_hidden_layers=2), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in tiny.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return tiny


@pytest.mark.parametrize("qtype,kernel", [(F32, True), (Q8_0, False), (Q8_0, True)])
def test_olmo2_file_against_the_hf_model(qtype, kernel, tmp_path, monkeypatch):
    """An olmo2 file as llama.cpp's converter writes it (its Olmo2Model keeps HF's tensors: NEOX rope, q/k
    not permuted; post_attention_norm / post_ffw_norm, attn_q_norm / attn_k_norm, no input norms).
    transformers cannot read olmo2 files, so the reference is the tiny HF Olmo2ForCausalLM itself (fp32):
    F32 logits within 1e-4 with the same argmax everywhere and the same greedy tokens from a prefix in
    shared KV slots; Q8_0 dequantized (kernel off) within 1e-4 of the HF model with Q8_0-rounded weights;
    Q8_0 kept quantized with the kernel (int8 activations) within 5% of the max |logit| of it, as the
    other architectures' Q8_0 files (measured here: 1.5%, argmax 39 of 40), and the same argmax on >= 90% of positions."""
    from transformers import AutoTokenizer

    from radixlm.runtime.models.gguf_loader import materialize_gguf
    from tests.unit.test_models_vs_hf import PagedRunner, assert_greedy_from_shared_prefix_matches_hf

    if qtype == Q8_0 and kernel and not cpu_supports_quant():
        pytest.skip("needs AVX512-VNNI")
    if not kernel:
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    tiny = olmo2_tiny()
    path = write_gguf(tiny, "olmo2", tmp_path / "gguf" / "olmo2.gguf", qtype)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight", "blk.1.attn_q_norm.weight"} <= names
    assert not any(n.endswith(("attn_norm.weight", "ffn_norm.weight")) for n in names)
    config = ModelConfig.from_path(str(path), dtype="float32")
    assert config.architecture == "Olmo2ForCausalLM" and config.sliding_window is None
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.eos_token_ids == [263, 261] and not config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(str(materialize_gguf(path)))       # converted without transformers' config
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 263
    model = load_model(config, "cpu", show_progress=False, disable_gguf_quant=False)
    assert isinstance(model.model.layers[1].mlp.gate_up_proj.packed_weight, QuantWeight) == (qtype == Q8_0)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    ours = _prefill_logits(model, config, ids, page_size=16)
    reference = q8_rounded_copy(tiny) if qtype == Q8_0 else tiny
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    diff, top = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    if qtype == Q8_0 and kernel:
        assert diff <= 0.05 * top, (diff, top)
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
        return
    assert diff <= 1e-4, (diff, top)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    if qtype == F32:
        runner = PagedRunner(model, config, page_size=16, num_pages=16)
        assert_greedy_from_shared_prefix_matches_hf(runner, tiny, VOCAB, new_tokens=8)


def test_olmo3_sliding_window_file_is_refused(tmp_path, monkeypatch):
    """llama.cpp writes OLMo 3 as olmo2 with a sliding window (every 4th layer global); not implemented."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(olmo2_tiny(), "olmo2", tmp_path / "src" / "olmo2.gguf", F32)
    bad = _with_key(path, tmp_path / "olmo3.gguf", "olmo2.attention.sliding_window", 16, gguf.GGUFValueType.UINT32)
    with pytest.raises(ModelLoadError, match="sliding_window is not implemented for olmo2"):
        ModelConfig.from_path(str(bad))
