"""Gemma 2, Gemma 3 (text) and OLMo 2 against HF transformers fp32, on tiny random models whose
norm weights are moved away from their neutral value, so a misplaced norm shows.

- Gemma 3: embedding scaling, (1 + w) norms, sandwich norms, q/k norm, query_pre_attn_scalar,
  GeGLU, a final logit soft-cap, and alternating 16-token sliding / global layers with their own
  rope bases (prompts longer than the window).
- Gemma 2: Gemma 3's decoder without the q/k norm, with attention-score soft-capping (small enough
  here to change every layer's output: the same model uncapped is far from HF), a final logit
  soft-cap, and alternating 16-token sliding / global layers.
- OLMo 2: post-attention / post-MLP norms and the q/k RMSNorm over the whole projection.

For each: logits for batched prefill, prefix extend and decode (C++ kernels and the torch path),
and greedy tokens for a prompt whose prefix comes from shared KV slots (a radix-cache hit)."""

from __future__ import annotations

import pytest
import torch
from test_models_vs_hf import (
    PagedRunner,
    assert_engine_radix_cache_matches_hf,
    assert_greedy_from_shared_prefix_matches_hf,
    assert_prefill_extend_decode_match_hf,
    load_ours,
    save_random_hf_model,
)

ATTN_CAP = 1.0


def hf_config(name: str):
    from transformers import Gemma2Config, Gemma3TextConfig, Olmo2Config

    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                  max_position_embeddings=256, initializer_range=0.1, eos_token_id=2, bos_token_id=0, pad_token_id=1)
    if name == "olmo2":
        return Olmo2Config(**common, num_hidden_layers=2, tie_word_embeddings=False)
    gemma = dict(**common, head_dim=16, num_hidden_layers=4, sliding_window=16, final_logit_softcapping=30.0)
    if name == "gemma2":
        config = Gemma2Config(**gemma, query_pre_attn_scalar=16, attn_logit_softcapping=ATTN_CAP)
        config.architectures = ["Gemma2ForCausalLM"]
        return config
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    config = Gemma3TextConfig(**gemma, query_pre_attn_scalar=32, rope_parameters=rope,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def perturb(model: str, name: str, p: torch.nn.Parameter) -> None:
    if "norm" in name:                # OLMo 2's norms around 1; Gemma scales by (1 + w): w around 0
        p.uniform_(0.5, 1.5) if model == "olmo2" else p.uniform_(-0.5, 0.5)
    elif model == "gemma2" and ("q_proj" in name or "k_proj" in name):   # scores of a few units, so the cap bites
        p.mul_(4.0)


FOLDERS: dict[str, str] = {}      # variant -> its checkpoint folder (for the Engine tests)


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "olmo2"])
def variant(request, tmp_path_factory, llama_path: str):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf_model(hf_config(request.param), folder, tokenizer_from=llama_path,
                              perturb=lambda name, p: perturb(request.param, name, p))
    FOLDERS[request.param] = str(folder)
    return (request.param, *load_ours(folder), hf)


def test_config_and_layers_follow_the_checkpoint(variant) -> None:
    name, config, model, _ = variant
    if name == "olmo2":
        assert model.model.decoder_blocker() == "post-attention / post-MLP norms"  # the one-call CPU decoder stays off
        return
    assert config.sliding_window_layers == (0, 2)
    if name == "gemma2":
        assert config.attn_logit_softcapping == ATTN_CAP
        assert model.model.layers[1].self_attn.attn.logit_cap == ATTN_CAP
    else:
        assert config.local_rope_theta == 10000.0 and config.rope_theta == 1e6
        assert model.model.decoder_blocker() == "embedding scaling (Gemma)"   # the one-call CPU decoder stays off


@pytest.mark.parametrize("use_kernels", [True, False])
def test_matches_hf(variant, use_kernels: bool) -> None:
    _, config, model, hf = variant
    runner = PagedRunner(model, config, page_size=16, num_pages=64, use_kernels=use_kernels)
    assert_prefill_extend_decode_match_hf(runner, hf, config.vocab_size)


def test_greedy_from_shared_prefix(variant) -> None:
    _, config, model, hf = variant
    runner = PagedRunner(model, config, page_size=16, num_pages=64)
    assert_greedy_from_shared_prefix_matches_hf(runner, hf, config.vocab_size)


@pytest.mark.parametrize("variant", ["gemma2"], indirect=True)
def test_gemma2_without_the_cap_differs(variant) -> None:
    """The soft-cap matters at these weights: the same model uncapped is far from HF."""
    _, config, model, hf = variant
    for layer in model.model.layers:
        layer.self_attn.attn.logit_cap = 0.0
    try:
        with pytest.raises(AssertionError):
            assert_prefill_extend_decode_match_hf(PagedRunner(model, config, 16, 64), hf, config.vocab_size)
    finally:
        for layer in model.model.layers:
            layer.self_attn.attn.logit_cap = ATTN_CAP


def test_engine_tp2(variant) -> None:
    """TP=2 over gloo through the scheduler (radix cache, chunked prefill, windows past 16 tokens):
    two rounds equal HF greedy. OLMo 2's q/k norm over the whole projection needs TP=1: refused."""
    from radixlm import Engine
    from radixlm.runtime.models.model_config import ModelLoadError

    name, config, _, hf = variant
    if name == "olmo2":
        with pytest.raises((ModelLoadError, RuntimeError), match="tensor parallel size 1"):
            Engine(model_path=FOLDERS[name], dtype="float32", tp_size=2, max_total_tokens=2048)
        return
    assert_engine_radix_cache_matches_hf(FOLDERS[name], hf, config.vocab_size, [40, 12, 20], context_length=256,
                                         min_cached=32, new_tokens=6, tp_size=2)
